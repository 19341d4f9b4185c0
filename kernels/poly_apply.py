"""The third product of a Polar Express iteration: ``out = alpha X + B X``.

B is [B, M, M] and symmetric (``b A + c A A`` from ``gram.py``), X and ``out`` are [B, M, N];
X may have any strides (the tall matrices run on a ``.mT`` view). One product of B's row
block and X's column block per output tile, fp32 accumulation, ``alpha X`` added in fp32 and
one rounding to out's dtype: what cuBLAS ``baddbmm(X, B, X, beta=alpha)`` computes, without
its copy of X into the output first. Tiles are numbered along a row of tiles first, so the
programs that run together share B's row block. Given the sums of squares, the first
iteration's ``s (alpha X + B X)``: the normalization's scale s folded in, X the caller's.
Given the parameters (``ParamApply``), the last iteration's: Muon's apply on the rounded
result, ``p = p (1 - lr wd) - adjusted_lr out``, in place of storing out.

As in ``gram.py``, a pointer kernel and, for the 16-bit layouts TMA reads (X and B; X may
be a ``.mT`` view), a persistent TMA one (``poly_apply_tma.py``, with the epilogue both
share), their configs candidates of one tuning key.

``poly_apply`` is the Triton launcher, ``poly_apply_reference`` the torch version it matches.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ._launch import (
    TUNER,
    Config,
    Memo,
    bench_ms,
    bucket,
    cdiv,
    check_scalars,
    dtype_name,
    launch_batched,
    tuning_batch,
)
from ._tma import tma_enabled, tma_layout
from ._triton import tl, triton
from .gram import _scratch, _scratch_scale, pointer_options
from .normalize import NormScale, norm_scale_arg, normalize_scale
from .poly_apply_tma import (
    ApplyArgs,
    ParamApply,
    _epilogue,
    _launch_tma,
    apply_kernel_args,
    epilogue_args,
)
from .shape_classes import fitting, shape_class, worth_timing

# ``block_m`` x ``block``: the output tile (rows x columns); ``chunk``: the K step (over M).
# Measured on the H200 (bench/orthogonalize.py and a sweep, 2026-11-29): 128 x 256 tiles with
# 8 warps are fastest from 12 x 512x2048 to 6 x 2048x4096 (0.61 ms on 128 x 768x2048, 128 x 128:
# 0.68 ms). Numbering tiles down a column of 2 tile rows first gained 2.5% there and lost 10% on
# 2048x4096, so it is not done. A loop over several tiles per program (flattened, so the next
# tile's loads overlap this one's epilogue) ran up to 1.5x slower with these pointer loads;
# with host TMA descriptors instead it took 0.575 ms (0.560 on the .mT view, against 0.617):
# hence the second kernel (``poly_apply_tma.py``, ``tma`` configs), for the layouts TMA reads.
POLY_APPLY_CONFIGS = (
    Config(block=256, block_m=128, chunk=64, num_warps=8, num_stages=3),
    Config(block=256, block_m=128, chunk=64, num_warps=8, num_stages=4),
    Config(block=128, block_m=128, chunk=64, num_warps=8, num_stages=4),
    Config(block=128, block_m=128, chunk=64, num_warps=4, num_stages=4),
    Config(block=256, block_m=64, chunk=64, num_warps=4, num_stages=4),
    Config(block=64, block_m=128, chunk=64, num_warps=4, num_stages=4),
    Config(block=256, block_m=128, chunk=64, num_warps=8, num_stages=3, tma=True, flatten=True),
    Config(block=256, block_m=128, chunk=64, num_warps=8, num_stages=4, tma=True, flatten=True),
    Config(block=128, block_m=128, chunk=64, num_warps=8, num_stages=4, tma=True, flatten=True),
    # Two programs a SM, each of 4 warps and 3 stages (96 KiB of shared memory): one's
    # epilogue overlaps the other's loads and products (H200, bench/product_configs.py:
    # 64 x 1024^2 0.247 ms against 0.258 for the 256-wide tile, one program a SM; even with
    # it on 128 x 1024^2 and 96 x 512x1024).
    Config(
        block=128,
        block_m=128,
        chunk=64,
        num_warps=4,
        num_stages=3,
        tma=True,
        flatten=True,
        programs_per_sm=2,
    ),
    Config(
        block=256, block_m=128, chunk=64, num_warps=8, num_stages=3, tma=True, warp_specialize=True
    ),
)
# fp32 operands take twice the shared memory per stage: the 16-bit configs would not fit.
POLY_APPLY_FP32_CONFIGS = (
    Config(block=128, block_m=64, chunk=32, num_warps=4, num_stages=3),
    Config(block=64, block_m=64, chunk=32, num_warps=4, num_stages=3),
)
# Without TMA (a layout it cannot read, or the switch off): made once, not per launch.
POLY_APPLY_POINTER_CONFIGS = tuple(c for c in POLY_APPLY_CONFIGS if not c.tma)
POLY_APPLY_INTERPRETER_CONFIG = Config(block=32, block_m=32, chunk=32)


@triton.jit(do_not_specialize=("b_start",))
def _poly_apply_kernel(
    poly,  # [B, M, M], symmetric
    x,  # [B, M, N]
    out,  # [B, M, N]
    b_start,  # index of the matrix that grid row 0 computes
    M,
    N,
    stride_pb,
    stride_pm,
    stride_pk,
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
    table,  # [B] int64, stride_pr, stride_pc, hyper: the apply's (APPLY), see _epilogue
    stride_pr,
    stride_pc,
    hyper,
    ADD_X: tl.constexpr,  # alpha != 0 (Gram Newton-Schulz's Q X has no X term)
    HAS_SCALE: tl.constexpr,  # x taken as s x, s = inverse_norm(sumsq[i_b])
    EVEN: tl.constexpr,  # M and N multiples of the tile, M of the K step: no masks
    APPLY: tl.constexpr,  # Muon's apply on the rounded result (U_DTYPE); out not written
    U_DTYPE: tl.constexpr,
    P_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64) + b_start
    tiles_n = tl.cdiv(N, BLOCK_N)
    r_m = (i_t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_n = (i_t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    poly += i_b * stride_pb
    x += i_b * stride_xb
    out += i_b * stride_ob
    if EVEN:
        p_p = poly + r_m[:, None] * stride_pm + o_k[None, :] * stride_pk
        p_x = x + o_k[:, None] * stride_xm + r_n[None, :] * stride_xn
    else:  # rows and columns past the end wrap onto valid ones (no masks); never stored
        p_p = poly + (r_m % M)[:, None] * stride_pm + o_k[None, :] * stride_pk
        p_x = x + o_k[:, None] * stride_xm + (r_n % N)[None, :] * stride_xn

    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(M, BLOCK_K)):
        if EVEN:
            b_p = tl.load(p_p)
            b_x = tl.load(p_x)
        else:
            k_left = M - k * BLOCK_K
            b_p = tl.load(p_p, mask=o_k[None, :] < k_left, other=0.0)
            b_x = tl.load(p_x, mask=o_k[:, None] < k_left, other=0.0)
        b_acc = tl.dot(b_p, b_x, b_acc, input_precision=PRECISION)
        p_p += BLOCK_K * stride_pk
        p_x += BLOCK_K * stride_xm

    p_x = x + r_m[:, None] * stride_xm + r_n[None, :] * stride_xn
    p_o = out + r_m[:, None] * stride_om + r_n[None, :] * stride_on
    _epilogue(
        b_acc, i_b, r_m, r_n, p_x, p_o, M, N, alpha, sumsq, norm_scale, eps_ptr, table,
        stride_pr, stride_pc, hyper, ADD_X, HAS_SCALE, EVEN, APPLY, U_DTYPE, P_DTYPE, ALIGNED,
    )  # fmt: skip


def _launch(
    poly: Tensor,
    x: Tensor,
    out: Tensor,
    alpha: float,
    config: Config,
    scale: NormScale | None = None,
    apply: ApplyArgs | None = None,
) -> None:
    """With ``apply`` (APPLY on), ``out`` is not written: any tensor stands in for it."""
    apply = apply or apply_kernel_args(None, None, x)
    if config.tma:
        _launch_tma(poly, x, out, alpha, config, scale, apply)
        return
    batch, m, n = x.shape
    tiles = cdiv(m, config.block_m) * cdiv(n, config.block)
    even = m % config.block_m == 0 and m % config.chunk == 0 and n % config.block == 0
    stride_pb, stride_pm, stride_pk = poly.stride()
    if stride_pk != 1 and stride_pm == 1:  # B = B^T: read it so that K stays contiguous
        stride_pm, stride_pk = stride_pk, stride_pm
    args, constexprs = epilogue_args(x, out, alpha, scale, apply, even)
    launch_batched(
        _poly_apply_kernel,
        tiles,
        batch,
        (poly, x, out),
        m,
        n,
        stride_pb,
        stride_pm,
        stride_pk,
        *args,
        **constexprs,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block,
        BLOCK_K=config.chunk,
        **pointer_options(config, x.dtype),
    )


def _check_apply(apply_to: ParamApply, out: Tensor | None, batch: int, device) -> None:
    if out is not None:
        raise ValueError("with apply_to, out is not written: give none")
    table = apply_to.table
    if (
        table.numel() != batch
        or not table.is_contiguous()
        or table.dtype != torch.int64
        or table.device != device
    ):
        raise ValueError(f"apply_to.table must be {batch} contiguous int64 on {device}")
    check_scalars(apply_to.scalars, 2, device)


def _span(t: Tensor) -> tuple[int, int]:
    """The byte range [first, last) that a tensor's elements occupy."""
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (extent + 1) * t.element_size()


def poly_apply(
    poly: Tensor,
    x: Tensor,
    *,
    alpha: float = 1.0,
    out: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    sumsq: Tensor | None = None,
    norm_scale: float | None = None,
    eps: float | Tensor | None = None,
    apply_to: ParamApply | None = None,
) -> Tensor | None:
    """``out = alpha x + poly @ x`` for a batch x [B, M, N] (any strides) and a symmetric
    ``poly`` [B, M, M] of x's dtype (``alpha = 0``: x is not read again, not even a NaN).
    ``out`` [B, M, N], any strides and float dtype, must not overlap x or poly (the kernel
    reads x again after other tiles are written); made when None, of ``out_dtype`` (default
    x's). Returns out.

    With ``sumsq`` ([B] fp32, contiguous), ``norm_scale`` and ``eps`` (a number or an fp32
    device tensor [1]): x is taken as normalized, ``s x`` with ``normalize``'s scale
    ``s = bf16(1 / (sqrt(sumsq) * norm_scale + eps))`` per matrix, so
    ``out = s (alpha x + poly @ x)`` in fp32, one rounding: Polar Express's first
    iteration on the caller's x, which is only read.

    With ``apply_to`` (``muon.param_apply``'s, a parameter per matrix), out is neither made
    nor written (give none) and None is returned: each element, rounded to ``out_dtype`` as
    out would be, goes into its parameter, ``p = p (1 - lr wd) - adjusted_lr u`` in fp32 as
    ``muon_apply_from_`` computes it, the same bits as out followed by that apply."""
    if x.ndim != 3:
        raise ValueError(f"expected x [B, M, N], got shape {tuple(x.shape)}")
    batch, m, n = x.shape
    scale = norm_scale_arg(sumsq, norm_scale, eps, batch, x.device)
    if poly.shape != (batch, m, m) or poly.device != x.device or poly.dtype != x.dtype:
        raise ValueError(f"poly must be [{batch}, {m}, {m}] {x.dtype} on {x.device}")
    if out is not None and out_dtype not in (None, out.dtype):
        raise ValueError(f"out is {out.dtype}, out_dtype {out_dtype}: give one")
    out_dtype = out.dtype if out is not None else out_dtype or x.dtype
    if apply_to is not None:
        _check_apply(apply_to, out, batch, x.device)
    elif out is None:
        out = torch.empty(batch, m, n, dtype=out_dtype, device=x.device)
    if out is not None and (out.shape != (batch, m, n) or out.device != x.device):
        raise ValueError(f"out must be [{batch}, {m}, {n}] on {x.device}")
    if batch * m * n == 0:
        return out
    if out is not None:
        lo, hi = _span(out)
        for name, t in (("x", x), ("poly", poly)):
            t_lo, t_hi = _span(t)
            if lo < t_hi and t_lo < hi:
                raise ValueError(f"out must not overlap {name}")
    # Never the batch in the key: the config sets the order of the sums, so a matrix's bits
    # would follow it.
    key, m_class, n_class = _tuning_key(poly, x, out_dtype, alpha != 0.0, scale is not None)
    # Nor the apply: the fused launch takes the config that the unfused out gets, so its bits
    # are that out's (and the apply's) on any GPU; the bench never runs the apply.

    def bench(config: Config) -> float:
        # Scratch inputs of the class's sizes and a batch fixed by them (same layouts), so the
        # choice depends on the class alone; scratch output.
        n_batch = tuning_batch(m_class * n_class)
        sp = _scratch(poly, n_batch, m_class, m_class)
        sx = _scratch(x, n_batch, m_class, n_class)
        so = torch.empty(n_batch, m_class, n_class, dtype=out_dtype, device=x.device)
        ss = None if scale is None else _scratch_scale(scale, n_batch)
        return bench_ms(lambda: _launch(sp, sx, so, alpha, config, ss))

    if x.element_size() > 2:
        configs = POLY_APPLY_FP32_CONFIGS
    else:
        configs = POLY_APPLY_CONFIGS if key[-1] else POLY_APPLY_POINTER_CONFIGS
    configs = fitting(configs, m_class, n_class)
    apply = apply_kernel_args(apply_to, out_dtype, x)
    # Every candidate inside compiling_ahead (``Tuner.choices``): the fused apply is a variant
    # of its own, which the bench never launches.
    for config in TUNER.choices(
        "poly_apply",
        key,
        configs,
        POLY_APPLY_INTERPRETER_CONFIG,
        x.device,
        bench if worth_timing(m_class, n_class) else None,
    ):
        _launch(poly, x, x if out is None else out, float(alpha), config, scale, apply)
    return out


# ``_tuning_key``'s answers by what they depend on (the layouts of poly and x among them:
# whether TMA reads them), so that a launch of a known layout reads no more of it.
_KEYS = Memo()


def _tuning_key(poly, x, out_dtype, add_x: bool, scaled: bool) -> tuple:
    """(poly_apply's tuning key, m's class, n's class)."""
    memo_key = (
        x.shape[1:],
        x.stride(),
        x.dtype,
        x.data_ptr() % 16,
        x.device,
        poly.stride(),
        poly.data_ptr() % 16,
        out_dtype,
        add_x,
        scaled,
        os.environ.get("MUON_OFFLOAD_TMA"),  # tma_enabled's switch, read per call
    )
    found = _KEYS.get(memo_key)
    if found is not None:
        return found
    tma = tma_enabled(x.device) and tma_layout(x) is not None and tma_layout(poly) is not None
    _, m, n = x.shape
    m_class, n_class = shape_class(m), bucket(n)
    key = (
        dtype_name(x.dtype),
        dtype_name(out_dtype),
        m_class,
        n_class,
        x.stride(-1) == 1,  # rows contiguous, or a transposed view
        poly.stride(-1) == 1,
        add_x,
        scaled,  # another compiled kernel (the scale's loads and multiply)
        tma,
    )
    return _KEYS.put(memo_key, (key, m_class, n_class))


def poly_apply_reference(
    poly: Tensor,
    x: Tensor,
    *,
    alpha: float = 1.0,
    out_dtype: torch.dtype | None = None,
    sumsq: Tensor | None = None,
    norm_scale: float | None = None,
    eps: float | Tensor | None = None,
) -> Tensor:
    """The same in fp32 (one rounding to out_dtype, default x's, at the end)."""
    acc = poly.float() @ x.float()
    if alpha != 0.0:
        acc = alpha * x.float() + acc
    if sumsq is not None:
        acc = acc * normalize_scale(sumsq, norm_scale=norm_scale, eps=eps).float()[:, None, None]
    return acc.to(out_dtype or x.dtype)
