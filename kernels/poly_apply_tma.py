"""``poly_apply``'s persistent TMA kernel (``poly_apply.py`` has the launcher that chooses it),
and the epilogue it shares with the pointer kernel there: a loop over (matrix, output tile)
items, tiles along a row first, operands read through host TMA descriptors as 3-D boxes (a
``.mT`` x described as stored and transposed in-kernel), the same fp32 accumulation in K
steps of ``chunk`` and the same epilogue as the pointer kernel (which also folds in the
normalization's scale, ``HAS_SCALE``, and Muon's apply, ``APPLY``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._launch import Config, Memo, cdiv, triton_dtype
from ._tma import (
    descriptor_template,
    from_template,
    persistent_grid,
    persistent_options,
    tma_layout,
)
from ._triton import tl, triton
from .muon_apply import ParamApply, apply_step
from .normalize import NormScale, inverse_norm, scale_kernel_args


class ApplyArgs(NamedTuple):
    """A product kernel's apply arguments (table, stride_pr, stride_pc, hyper) and
    constexprs, as launched."""

    args: tuple
    constexprs: dict


def apply_kernel_args(
    apply_to: ParamApply | None, u_dtype: torch.dtype | None, unread: Tensor
) -> ApplyArgs:
    """``apply_to``'s, the product rounded to ``u_dtype``; without it (APPLY off, never
    read), ``unread`` in the pointer places."""
    if apply_to is None:
        constexprs = dict(APPLY=False, U_DTYPE=None, P_DTYPE=None, ALIGNED=False)
        return ApplyArgs((unread, 0, 0, unread), constexprs)
    constexprs = dict(
        APPLY=True,
        U_DTYPE=triton_dtype(u_dtype),
        P_DTYPE=triton_dtype(apply_to.dtype),
        ALIGNED=apply_to.aligned,
    )
    return ApplyArgs((apply_to.table, *apply_to.strides, apply_to.scalars), constexprs)


@triton.jit
def _epilogue(
    b_acc,  # [BLOCK_M, BLOCK_N] fp32: P x, rows r_m and columns r_n of matrix i_b (int64)
    i_b,
    r_m,
    r_n,
    p_x,  # x's and out's elements at (r_m, r_n)
    p_o,
    M,
    N,
    alpha,
    sumsq,
    norm_scale,
    eps_ptr,
    table,  # [B] int64 parameter addresses, read only when APPLY
    stride_pr,  # a parameter's element (r, c) at r stride_pr + c stride_pc
    stride_pc,
    hyper,  # fp32 [2]: 1 - lr wd, adjusted_lr (muon.apply_scalars), read only when APPLY
    ADD_X: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EVEN: tl.constexpr,
    APPLY: tl.constexpr,  # Muon's apply on the rounded result; out is not written
    U_DTYPE: tl.constexpr,  # with APPLY: the dtype the unfused out has (the rounding)
    P_DTYPE: tl.constexpr,  # with APPLY: the parameters' dtype
    ALIGNED: tl.constexpr,  # with APPLY: every parameter address a multiple of 16 bytes
):
    """alpha x + acc (s (alpha x + acc) with HAS_SCALE), fp32, one rounding, stored; with
    APPLY, the rounded value u goes into ``p = p decay - adjusted_lr u`` instead, as
    ``muon.py``'s apply kernel computes it from a stored out (the same bits)."""
    if HAS_SCALE:  # the normalization folded in: alpha (s x) + P (s x) = s (alpha x + P x)
        s = inverse_norm(sumsq, i_b, norm_scale, eps_ptr, True)
    if EVEN:
        mask = None
        if ADD_X:
            b_acc += alpha * tl.load(p_x).to(tl.float32)
    else:
        mask = (r_m[:, None] < M) & (r_n[None, :] < N)
        if ADD_X:
            b_acc += alpha * tl.load(p_x, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        b_acc *= s
    if APPLY:
        p_p = tl.load(table + i_b).to(tl.pointer_type(P_DTYPE))
        if ALIGNED:
            p_p = tl.multiple_of(p_p, 16)
        # int64: one parameter may hold more than 2^31 elements
        p_p += r_m.to(tl.int64)[:, None] * stride_pr + r_n.to(tl.int64)[None, :] * stride_pc
        decay = tl.load(hyper)
        lr = tl.load(hyper + 1)
        u = b_acc.to(U_DTYPE).to(tl.float32)
        x = tl.load(p_p, mask=mask).to(tl.float32)
        x = apply_step(x, u, decay, lr)  # _muon_apply_kernel's: the same bits
        tl.store(p_p, x.to(P_DTYPE), mask=mask)
    else:
        tl.store(p_o, b_acc.to(p_o.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=("items",))
def _poly_apply_tma_kernel(
    p_desc,  # poly [B, M, M] box [1, BLOCK_M, BLOCK_K] (rows contiguous: B = B^T if need be)
    x_desc,  # x [B, M, N] box [1, BLOCK_K, BLOCK_N]; X_T: x.mT [B, N, M] box [1, BLOCK_N, BLOCK_K]
    x,  # [B, M, N], read again for alpha X (ADD_X)
    out,  # [B, M, N]
    items,  # batch x tiles
    M,
    N,
    stride_xb,
    stride_xm,
    stride_xn,
    stride_ob,
    stride_om,
    stride_on,
    alpha,
    sumsq,  # [B] fp32, read only when HAS_SCALE
    norm_scale,
    eps_ptr,  # fp32 [1], read only when HAS_SCALE
    table,  # [B] int64, stride_pr, stride_pc, hyper: the apply's (APPLY), as in _epilogue
    stride_pr,
    stride_pc,
    hyper,
    ADD_X: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EVEN: tl.constexpr,  # M and N multiples of the tile: no masks on the epilogue
    APPLY: tl.constexpr,
    U_DTYPE: tl.constexpr,
    P_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    X_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """The pointer kernel's sums and epilogue, persistent, its operands read by TMA: a loop
    over (matrix, tile) items, tiles along a row first as there. TMA fills rows and columns
    past the end with zeros (no masks on loads)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for item in tl.range(
        tl.program_id(0),
        items,
        tl.num_programs(0),
        flatten=FLATTEN,
        warp_specialize=WARP_SPECIALIZE,
    ):
        i_b = item // tiles
        i_t = item % tiles
        off_m = (i_t // tiles_n) * BLOCK_M
        off_n = (i_t % tiles_n) * BLOCK_N
        b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(M, BLOCK_K)):
            b_p = p_desc.load([i_b, off_m, k * BLOCK_K]).reshape(BLOCK_M, BLOCK_K)
            if X_T:
                b_x = x_desc.load([i_b, off_n, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
            else:
                b_x = x_desc.load([i_b, k * BLOCK_K, off_n]).reshape(BLOCK_K, BLOCK_N)
            b_acc = tl.dot(b_p, b_x, b_acc)

        r_m = off_m + tl.arange(0, BLOCK_M)
        r_n = off_n + tl.arange(0, BLOCK_N)
        i_b64 = i_b.to(tl.int64)
        p_x = x + i_b64 * stride_xb + r_m[:, None] * stride_xm + r_n[None, :] * stride_xn
        p_o = out + i_b64 * stride_ob + r_m[:, None] * stride_om + r_n[None, :] * stride_on
        _epilogue(
            b_acc, i_b64, r_m, r_n, p_x, p_o, M, N, alpha, sumsq, norm_scale, eps_ptr, table,
            stride_pr, stride_pc, hyper, ADD_X, HAS_SCALE, EVEN, APPLY, U_DTYPE, P_DTYPE, ALIGNED,
        )  # fmt: skip


# What a TMA launch derives from its config and operands' layouts (_tma_plan), by them.
_PLANS = Memo()


def _launch_tma(
    poly: Tensor,
    x: Tensor,
    out: Tensor,
    alpha: float,
    config: Config,
    scale: NormScale | None,
    apply: ApplyArgs,
) -> None:
    """``_launch`` on the persistent TMA kernel (poly and x: ``tma_layout`` not None)."""
    key = (id(config), x.shape, x.stride(), x.dtype, x.data_ptr() % 16, x.device)
    key += (poly.stride(), poly.data_ptr() % 16)
    plan = _PLANS.get(key)
    if plan is None or plan[0] is not config:  # (the config held: its id names it)
        plan = _PLANS.put(key, _tma_plan(poly, x, config))
    _, p_t, p_template, x_t, x_template, grid, items, even, options = plan
    # B = B^T: a column-major poly is described as its transpose, rows contiguous.
    p_desc = from_template(p_template, poly.mT if p_t else poly)
    x_desc = from_template(x_template, x.mT if x_t else x)
    args, constexprs = epilogue_args(x, out, alpha, scale, apply, even)
    _, m, n = x.shape
    _poly_apply_tma_kernel[grid](
        p_desc, x_desc, x, out, items, m, n, *args, **constexprs, **options
    )


def _tma_plan(poly: Tensor, x: Tensor, config: Config) -> tuple:
    """(config, poly's layout and descriptor template, x's, grid, items, EVEN, launch
    keywords)."""
    batch, m, n = x.shape
    items = batch * cdiv(m, config.block_m) * cdiv(n, config.block)
    even = m % config.block_m == 0 and n % config.block == 0
    p_t, x_t = tma_layout(poly), tma_layout(x)
    p_template = descriptor_template(poly, p_t, (config.block_m, config.chunk))
    box = (config.block, config.chunk) if x_t else (config.chunk, config.block)
    x_template = descriptor_template(x, x_t, box)
    options = dict(
        X_T=x_t,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block,
        BLOCK_K=config.chunk,
        **persistent_options(config),
    )
    grid = (persistent_grid(items, config, x.device),)
    return config, p_t, p_template, x_t, x_template, grid, items, even, options


def epilogue_args(x, out, alpha: float, scale: NormScale | None, apply: ApplyArgs, even: bool):
    """``_epilogue``'s launch arguments, the same for both kernels: the runtime ones from x's
    strides to the apply's (in the kernels' order) and the constexprs."""
    sumsq, norm_scale, eps = scale_kernel_args(scale, out)
    args = (*x.stride(), *out.stride(), alpha, sumsq, norm_scale, eps, *apply.args)
    constexprs = dict(
        ADD_X=alpha != 0.0, HAS_SCALE=scale is not None, EVEN=even, **apply.constexprs
    )
    return args, constexprs
