"""Muon's element-wise passes around the orthogonalization, for a batch of same-shape matrices.

prep:  M = mu M + G (in place); U = mu M + G with nesterov, else M; U stored in bf16, with
       each matrix's sum of squares of the stored bf16 values (the orthogonalizer's norm).
apply: X = X (1 - lr wd) - adjusted_lr U.

``muon_prep`` and ``muon_apply_`` are the Triton launchers (one launch for the whole batch;
the matrices are separate tensors read through a pointer table); the ``*_reference`` functions
(``muon_reference.py``, re-exported here) are the plain-torch versions they are tested
against. ``param_apply`` hands the apply to the orthogonalization's last product instead
(``poly_apply.py``'s epilogue: U is never stored).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ._grad_index import (
    GradIndex,
    TabledGrads,
    grad_index_for,
    grads_aligned,
    grads_dtype,
    scratch_grads,
)
from ._launch import (
    DTYPE,
    FP_FUSION,
    SHAPE,
    TABLES,
    TUNER,
    Config,
    all_aligned,
    bench_ms,
    bucket,
    cdiv,
    check_lists,
    device_scalars,
    dtype_name,
    scalar_arg,
    scratch_like,
    triton_dtype,
)
from ._triton import tl, triton
from .muon_apply import ParamApply, apply_step, check_apply
from .muon_reference import (  # noqa: F401  (re-exported: the references' importers)
    ApplyHyper,
    apply_scalars,
    muon_apply_reference_,
    muon_prep_reference,
    new_outputs,
)
from .sumsq import LOG2_SUMSQ_BLOCK, SUMSQ_BLOCK, SUMSQ_CHUNK, groups_for, sum_partials, tree_sum

if TYPE_CHECKING:  # typing_extensions (a torch dependency): Unpack on Python 3.10
    from typing_extensions import Unpack

# prep: one group of the sum of squares (``sumsq.py``) per program, ``SUMSQ_BLOCK`` lanes:
# the tiles are the sum's order, fixed, so only the warps are tuned. A 768x2048 matrix is
# 1.5 Mi elements: 32 Ki groups give 48 programs per matrix, so a batch of 4 fills 132 SMs.
PREP_CONFIGS = tuple(Config(block=SUMSQ_BLOCK, chunk=SUMSQ_CHUNK, num_warps=w) for w in (8, 4, 16))
PREP_INTERPRETER_CONFIG = PREP_CONFIGS[0]

# apply: 2-D tiles of block_m x block (rows x columns) so a transposed update view is read
# along its contiguous dimension and the parameter along its own.
APPLY_CONFIGS = (
    Config(block=128, block_m=32, num_warps=8),
    Config(block=64, block_m=64, num_warps=8),
    Config(block=256, block_m=16, num_warps=8),
    Config(block=128, block_m=64, num_warps=8),
    Config(block=64, block_m=32, num_warps=4),
)
APPLY_INTERPRETER_CONFIG = Config(block=32, block_m=16, num_warps=4)


@triton.jit
def _momentum_step(m, g, mu, NESTEROV: tl.constexpr):
    """dion's momentum rule on fp32 values -> (m, update): m = mu m + g, the update m or, with
    NESTEROV, mu m + g (this kernel's and the 8-bit one's, quantized_muon.py)."""
    m = m * mu + g
    return m, m * mu + g if NESTEROV else m


@triton.jit
def _prep_tile(m_ptr, g_ptr, u_ptr, offs, mask, mu, NESTEROV: tl.constexpr):
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m, u = _momentum_step(m, g, mu, NESTEROV)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    u = u.to(u_ptr.dtype.element_ty)
    tl.store(u_ptr + offs, u, mask=mask)
    return u.to(tl.float32)


@triton.jit(do_not_specialize=("chunks",))
def _muon_prep_kernel(
    table,  # [B, 2] int64: momentum address, the gradient's row in grads
    grads,  # int64: gradient addresses (GradIndex.table)
    out,  # [B, numel] update, contiguous
    partial,  # [B, chunks] fp32 partial sums of squares
    numel,  # elements per matrix
    chunks,  # programs per matrix
    mu_ptr,  # fp32 [1]: mu (read from memory: a CUDA graph replays new values)
    M_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    NESTEROV: tl.constexpr,
    CHUNK: tl.constexpr,  # SUMSQ_CHUNK and SUMSQ_BLOCK: sumsq.py's order
    BLOCK: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    start = i_c * CHUNK
    m_ptr = tl.load(table + i_b * 2).to(tl.pointer_type(M_DTYPE)) + start
    # Read through grads (rewritten each step by the engine): a captured launch reads this
    # step's gradient wherever backward put it.
    g_ptr = tl.load(grads + tl.load(table + i_b * 2 + 1)).to(tl.pointer_type(G_DTYPE)) + start
    if ALIGNED:
        m_ptr = tl.multiple_of(m_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
    u_ptr = out + i_b * numel + start
    count = tl.minimum(numel - start, CHUNK)
    mu = tl.load(mu_ptr)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    n_full = count // BLOCK
    for i_t in range(n_full):
        u = _prep_tile(m_ptr, g_ptr, u_ptr, i_t * BLOCK + offs, None, mu, NESTEROV)
        acc += u * u
    tail = count - n_full * BLOCK
    if tail > 0:
        mask = offs < tail
        u = _prep_tile(m_ptr, g_ptr, u_ptr, n_full * BLOCK + offs, mask, mu, NESTEROV)
        acc += tl.where(mask, u * u, 0.0)
    tl.store(partial + i_b * chunks + i_c, tree_sum(acc, LOG2_BLOCK))


@triton.jit
def _muon_apply_kernel(
    table,  # [B] int64: parameter addresses (each a contiguous rows x cols matrix)
    update,  # [B, rows, cols] with strides below
    rows,
    cols,
    stride_ub,
    stride_ur,
    stride_uc,
    hyper,  # fp32 [2]: 1 - lr * weight_decay, adjusted_lr (apply_scalars)
    X_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    CAUTIOUS: tl.constexpr,  # dion's cautious_wd: no decay where u and x differ in sign
):
    i_t = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    tiles_c = tl.cdiv(cols, BLOCK)
    r = (i_t // tiles_c) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = (i_t % tiles_c) * BLOCK + tl.arange(0, BLOCK)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    x_ptr = tl.load(table + i_b).to(tl.pointer_type(X_DTYPE))
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
    p_x = x_ptr + r[:, None] * cols + c[None, :]
    p_u = update + i_b * stride_ub + r[:, None] * stride_ur + c[None, :] * stride_uc
    decay = tl.load(hyper)
    alpha = tl.load(hyper + 1)
    u = tl.load(p_u, mask=mask).to(tl.float32)
    x = tl.load(p_x, mask=mask).to(tl.float32)
    if CAUTIOUS:  # as muon_apply_reference_ (elementwise_reference.cautious_decay)
        decay = tl.where(u * x >= 0, decay, 1.0)
    x = apply_step(x, u, decay, alpha)
    tl.store(p_x, x.to(X_DTYPE), mask=mask)


def _table(name: str, tensors_lists: Sequence[Sequence[Tensor]], grad_rows=None) -> Tensor:
    """A batch's pointer table, one row a matrix; ``grad_rows``: a last column of rows of a
    gradient table (``GradIndex``) instead of addresses."""
    cols = [list(map(Tensor.data_ptr, ts)) for ts in tensors_lists]
    if grad_rows is not None:
        cols.append(grad_rows)
    ptrs = tuple(zip(*cols, strict=True))
    device = tensors_lists[0][0].device
    return TABLES.get((name, device, ptrs), lambda: np.array(ptrs, dtype=np.int64), device)


def _check_matrices(names, lists) -> int:
    """Validate a batch of same-shape, same-dtype matrices; return the batch size."""
    check_lists(names, lists)
    if not lists[0]:
        raise ValueError("empty batch")
    shape = lists[0][0].shape
    for name, tensors in zip(names, lists, strict=True):
        if set(map(SHAPE, tensors)) == {shape} and len(set(map(DTYPE, tensors))) == 1:
            continue  # the usual case, checked by loops in C; else find the first that differs
        for i, t in enumerate(tensors):
            if t.shape != shape or t.dtype != tensors[0].dtype:
                raise ValueError(
                    f"{name}[{i}] is {t.dtype} {tuple(t.shape)}, expected "
                    f"{tensors[0].dtype} {tuple(shape)}"
                )
    return len(lists[0])


def _prep_launch(momentums, grads, index, mu, nesterov, out, partial, config: Config) -> None:
    batch = len(momentums)
    numel = momentums[0].numel()
    chunks = groups_for(numel)
    grad_table, grad_rows = grad_index_for(grads, index)
    _muon_prep_kernel[(chunks, batch)](
        _table("muon_prep", (momentums,), grad_rows),
        grad_table,
        out,
        partial,
        numel,
        chunks,
        mu,
        triton_dtype(momentums[0].dtype),
        triton_dtype(grads_dtype(grads)),
        NESTEROV=nesterov,
        CHUNK=SUMSQ_CHUNK,
        BLOCK=SUMSQ_BLOCK,
        LOG2_BLOCK=LOG2_SUMSQ_BLOCK,
        ALIGNED=all_aligned((momentums,)) and grads_aligned(grads),
        num_warps=config.num_warps,
        # mu*M + G rounded after the product, as the reference's separate mul_ and add_:
        # U then matches the reference bit for bit on the GPU.
        enable_fp_fusion=False,
    )


def prep_outputs(batch: int, shape, device, out: Tensor | None, sumsq: Tensor | None):
    """A prep kernel's outputs (dense and 8-bit): ``out`` contiguous [batch, *shape] (bf16 when
    not given) and ``sumsq`` fp32 [batch], allocated when None, checked when given."""
    numel = math.prod(shape)
    out, sumsq = new_outputs(batch, shape, device, out, sumsq)
    if out.numel() != batch * numel or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous [{batch}, *{tuple(shape)}] tensor on {device}")
    if sumsq.shape != (batch,) or sumsq.dtype != torch.float32:
        raise ValueError(f"sumsq must be fp32 of shape [{batch}]")
    return out, sumsq


def muon_prep(
    momentums: Sequence[Tensor],
    grads: Sequence[Tensor] | TabledGrads,
    *,
    mu: float | Tensor,
    nesterov: bool,
    out: Tensor | None = None,
    sumsq: Tensor | None = None,
    grad_index: GradIndex | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused momentum update + update matrix + sum of squares for a batch of same-shape
    matrices, in one launch (plus a [B, groups] -> [B] sum). Same math as
    ``muon_prep_reference``: U rounded to nearest even once; ``sumsq`` sums the stored
    values in ``sumsq.py``'s order, bit for bit ``sum_squares(out)`` whatever the batch.
    ``out`` must be contiguous [B, m, n] (bf16 unless the caller wants otherwise). ``mu``: a
    number, or an fp32 tensor on the device holding it (read by the kernel: the engine's step
    table). ``grad_index``: where the kernel reads the gradients' addresses, one row a matrix
    (the engine's step table of them, ``_launch.GradIndex``); None: their own. ``grads`` may
    then be their description (``TabledGrads``) instead of a tensor a matrix."""
    if isinstance(grads, TabledGrads):
        batch = _check_matrices(("momentums",), (momentums,))
        grads.check(batch, momentums[0].shape, momentums[0].device, grad_index)
    else:
        batch = _check_matrices(("momentums", "grads"), (momentums, grads))
    shape = momentums[0].shape
    device = momentums[0].device
    numel = momentums[0].numel()
    out, sumsq = prep_outputs(batch, shape, device, out, sumsq)
    mu = scalar_arg(mu, device)
    if numel == 0:
        sumsq.zero_()
        return out, sumsq
    key = (
        dtype_name(momentums[0].dtype),
        dtype_name(grads_dtype(grads)),
        dtype_name(out.dtype),
        bucket(numel),  # no batch: the configs differ in warps only, never in results
        bool(nesterov),
    )

    def bench(config: Config) -> float:
        scratch_m, scratch_g = scratch_like(momentums), scratch_grads(grads)
        scratch_out = torch.empty_like(out)
        part = torch.empty(batch, groups_for(numel), device=device)
        return bench_ms(
            lambda: _prep_launch(
                scratch_m, scratch_g, None, mu, nesterov, scratch_out, part, config
            )
        )

    partial = torch.empty(batch, groups_for(numel), device=device)
    # Every candidate inside compiling_ahead (``Tuner.choices``): the caller's alignment.
    for config in TUNER.choices(
        "muon_prep", key, PREP_CONFIGS, PREP_INTERPRETER_CONFIG, device, bench
    ):
        _prep_launch(momentums, grads, grad_index, mu, bool(nesterov), out, partial, config)
    sum_partials(partial, sumsq)
    return out, sumsq


def _apply_launch(params, update, rows, cols, scalars, config: Config, cautious=False) -> None:
    batch = len(params)
    tiles = cdiv(rows, config.block_m) * cdiv(cols, config.block)
    _muon_apply_kernel[(tiles, batch)](
        _table("muon_apply", (params,)),
        update,
        rows,
        cols,
        update.stride(0),
        update.stride(1),
        update.stride(2),
        scalars,
        triton_dtype(params[0].dtype),
        BLOCK_M=config.block_m,
        BLOCK=config.block,
        ALIGNED=all_aligned((params,)),
        CAUTIOUS=cautious,
        num_warps=config.num_warps,
        enable_fp_fusion=FP_FUSION,
    )


def muon_apply_(
    params: Sequence[Tensor],
    update: Tensor,
    *,
    cautious_wd: bool = False,
    **hyper: Unpack[ApplyHyper],
) -> None:
    """X = X (1 - lr wd) - adjusted_lr U for a batch in one launch, math in fp32 (with
    ``cautious_wd``, the decay only where U and X agree in sign: ``muon_apply_reference_``).

    ``params`` are contiguous tensors of m*n elements each, read as row-major [m, n];
    ``update`` is [B, m, n] with any strides (a ``.mT`` view of a contiguous [B, n, m]
    tensor is read along its contiguous dimension)."""
    scalars = apply_scalars(**hyper)
    device = params[0].device if params else update.device
    muon_apply_from_(params, update, device_scalars(scalars, device), cautious_wd)


def muon_apply_from_(
    params: Sequence[Tensor], update: Tensor, scalars: Tensor, cautious_wd: bool = False
) -> None:
    """``muon_apply_`` with its runtime scalars (``apply_scalars``' two, fp32) read on the
    device from ``scalars`` (the engine's step table: what a CUDA graph replays)."""
    rows, cols = check_apply(params, update, scalars)
    if rows * cols == 0:
        return
    batch, device = len(params), update.device
    transposed = update.stride(2) != 1
    key = (
        dtype_name(params[0].dtype),
        dtype_name(update.dtype),
        bucket(rows),
        bucket(cols),
        bucket(batch),
        "t" if transposed else "n",
    )

    def bench(config: Config) -> float:
        scratch_x = scratch_like(params)
        scratch_u = torch.randn_like(update, dtype=torch.float32).to(update.dtype)
        if transposed:  # same strides as the caller's view
            scratch_u = torch.empty_strided(
                update.shape, update.stride(), dtype=update.dtype, device=device
            ).copy_(scratch_u)
        return bench_ms(lambda: _apply_launch(scratch_x, scratch_u, rows, cols, scalars, config))

    # Every candidate inside compiling_ahead (``Tuner.choices``): the caller's alignment and
    # ``cautious_wd``, which the bench leaves out.
    for config in TUNER.choices(
        "muon_apply", key, APPLY_CONFIGS, APPLY_INTERPRETER_CONFIG, device, bench
    ):
        _apply_launch(params, update, rows, cols, scalars, config, cautious_wd)


def param_apply(params: Sequence[Tensor], cols: int, scalars: Tensor) -> ParamApply:
    """``muon_apply_from_(params, u, scalars)`` for the product that computes u [B, rows,
    cols], done by its epilogue (``poly_apply``'s ``apply_to``); operands checked by the
    caller (``check_apply``). The table is the apply kernel's, so a CUDA graph holds it."""
    table = _table("muon_apply", (params,))
    return ParamApply(table, params[0].dtype, (cols, 1), scalars, all_aligned((params,)))
