"""Muon's prep on 8-bit momentum (the format: quant_maps.py): M = mu M + G requantized in
place, the update U in bf16 and each matrix's sum of squares of U, with the torch reference it
is tested against. Blocks are counted over each matrix's own elements, and the sums are
reduced in an order fixed by the matrix shape: no result depends on how matrices are batched.
"""

from __future__ import annotations

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
    TABLES,
    TUNER,
    Config,
    aligned_addresses,
    bench_ms,
    cdiv,
    dtype_name,
    scalar_arg,
    scratch_like,
    triton_dtype,
)
from ._triton import tl, triton
from .config import chunked
from .elementwise import _typed
from .muon import _momentum_step, muon_prep_reference, prep_outputs
from .muon_reference import PrepKeywords
from .quant_maps import (
    _INV127,
    _QB,
    _SALT_M,
    _block_tile,
    _ld,
    _load_state,
    _store_state,
    check_segments,
    dequantize,
    requantize_,
)
from .quantized_elementwise import INTERPRETER_CONFIG, _state_ptrs

if TYPE_CHECKING:  # typing_extensions (a torch dependency): Unpack on Python 3.10
    from typing_extensions import Unpack

PREP_CONFIGS = chunked((2048, 32768, 8), (1024, 16384, 4), (4096, 32768, 8), (2048, 8192, 8))
# Two blocks a tile, two tiles a program: the element-wise 8-bit kernels' interpreter config.
PREP_INTERPRETER_CONFIG = INTERPRETER_CONFIG
SUM_BLOCK = 64  # partial sums a step of the final per-matrix sum (fixed: fixes its order)


# ----------------------------------------------------------------------------- Triton


@triton.jit
def _prep8_tile(
    mc_ptr,
    ms_ptr,
    g_ptr,
    u_ptr,
    mu,
    start,
    count,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    NESTEROV: tl.constexpr,
):
    """Returns the tile's sums of squares of the stored update a block (masked elements: 0)."""
    offs, i_b, col = _block_tile(start, BLOCK)
    mask = offs < count if MASKED else None
    bmask = i_b * _QB < count if MASKED else None
    g = _ld(g_ptr + offs, mask, MASKED).to(tl.float32)
    m = _load_state(mc_ptr, ms_ptr, offs, i_b, mask, bmask, MASKED, 2, _INV127)
    m, u = _momentum_step(m, g, mu, NESTEROV)
    u = u.to(u_ptr.dtype.element_ty)
    tl.store(u_ptr + offs, u, mask=mask)
    _store_state(m, mc_ptr, ms_ptr, offs, i_b, col, mask, bmask, 2, 127, _INV127, True, _SALT_M)
    u = u.to(tl.float32)
    return tl.sum(u * u, axis=1)  # masked elements are 0


@triton.jit(do_not_specialize=("chunks",))
def _prep8_kernel(
    table,  # [B, 3] int64: momentum codes, momentum scales addresses, gradient row in grads
    grads,  # int64: gradient addresses (GradIndex.table)
    out,  # [B, numel] update, contiguous
    partial,  # [B, chunks] fp32 partial sums of squares
    numel,  # elements per matrix
    chunks,  # programs per matrix
    mu_ptr,  # fp32 [1]: mu, read from memory (a CUDA graph replays new values)
    G_DTYPE: tl.constexpr,
    NESTEROV: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_m = tl.program_id(1).to(tl.int64)
    row = table + i_m * 3
    start = i_c * CHUNK
    mc_ptr, ms_ptr = _state_ptrs(row, 0, tl.int8, start, ALIGNED)
    g_ptr = _typed(grads, tl.load(row + 2), G_DTYPE, start, ALIGNED)  # a row of grads
    u_ptr = out + i_m * numel + start
    count = tl.minimum(numel - start, CHUNK)
    mu = tl.load(mu_ptr)
    acc = tl.zeros([BLOCK // _QB], dtype=tl.float32)
    n_full = count // BLOCK
    for i_t in range(n_full):
        acc += _prep8_tile(
            mc_ptr, ms_ptr, g_ptr, u_ptr, mu, i_t * BLOCK, count, BLOCK, False, NESTEROV
        )
    if n_full * BLOCK < count:
        acc += _prep8_tile(
            mc_ptr, ms_ptr, g_ptr, u_ptr, mu, n_full * BLOCK, count, BLOCK, True, NESTEROV
        )
    tl.store(partial + i_m * chunks + i_c, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=("chunks",))
def _row_sum_kernel(partial, out, chunks, BLOCK: tl.constexpr):
    # One program a matrix, one fixed order: the sum depends on the matrix's chunk count
    # only, never on how many matrices share the launch.
    i_m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, chunks, BLOCK):
        acc += tl.load(partial + i_m * chunks + i + offs, mask=i + offs < chunks, other=0.0)
    tl.store(out + i_m, tl.sum(acc, axis=0))


# ----------------------------------------------------------------------------- launcher


def _prep8_launch(m_codes, m_scales, grads, index, mu, nesterov, out, partial, config) -> None:
    batch, numel = len(m_codes), m_codes[0].numel()
    chunks = partial.shape[1]
    codes = list(map(Tensor.data_ptr, m_codes))
    aligned = aligned_addresses(codes) and grads_aligned(grads)
    grad_table, grad_rows = grad_index_for(grads, index)
    # The table holds the gradients' rows of grad_table, not their addresses.
    ptrs = tuple(zip(codes, map(Tensor.data_ptr, m_scales), grad_rows, strict=True))
    device = m_codes[0].device
    table = TABLES.get(("muon_prep8", device, ptrs), lambda: np.array(ptrs, np.int64), device)
    _prep8_kernel[(chunks, batch)](
        table,
        grad_table,
        out,
        partial,
        numel,
        chunks,
        mu,
        triton_dtype(grads_dtype(grads)),
        NESTEROV=nesterov,
        CHUNK=config.chunk,
        BLOCK=config.block,
        ALIGNED=aligned,
        num_warps=config.num_warps,
        enable_fp_fusion=False,
    )


def muon_prep8(
    m_codes: Sequence[Tensor],
    m_scales: Sequence[Tensor],
    grads: Sequence[Tensor] | TabledGrads,
    *,
    mu: float | Tensor,
    nesterov: bool,
    out: Tensor | None = None,
    sumsq: Tensor | None = None,
    grad_index: GradIndex | None = None,
) -> tuple[Tensor, Tensor]:
    """``muon_prep`` on 8-bit momentum: M = mu M + G (requantized in place), U = mu M + G
    with nesterov else M, stored in ``out`` (bf16 [B, m, n] by default), and each matrix's
    sum of squares of the stored U (``mu``: a number or an fp32 device tensor holding it).
    ``m_codes[i]`` is int8 with the matrix's shape, ``m_scales[i]`` fp32
    [ceil(m n / QBLOCK)]. The sum's order depends on the matrix shape only (the config is
    chosen by shape, the final sum is one fixed-order program a matrix): a matrix gives the
    same bits in a batch of 1 or 40. ``grad_index`` and ``grads`` as ``muon_prep``'s."""
    if not m_codes:
        raise ValueError("empty batch")
    shape, numel = m_codes[0].shape, m_codes[0].numel()
    batch = len(m_codes)
    states = [("m_codes", m_codes, m_scales, "momentum")]
    if isinstance(grads, TabledGrads):  # described, checked by the engine: the codes alone
        check_segments(m_codes, None, states)
        grads.check(batch, shape, m_codes[0].device, grad_index)
    else:
        check_segments(m_codes, grads, states)
        if any(g.shape != shape or g.dtype != grads[0].dtype for g in grads):
            raise ValueError(f"grads must all be {grads[0].dtype} of shape {tuple(shape)}")
    device = m_codes[0].device
    out, sumsq = prep_outputs(batch, shape, device, out, sumsq)
    mu = scalar_arg(mu, device)
    if numel == 0:
        sumsq.zero_()
        return out, sumsq
    # No batch in the key: a shape gets one config whatever the batch, so its sums of
    # squares are summed in one order.
    key = (dtype_name(grads_dtype(grads)), dtype_name(out.dtype), tuple(shape), bool(nesterov))

    def bench(config: Config) -> float:
        codes = [torch.randint_like(c, -100, 100) for c in m_codes]
        scales = scratch_like(m_scales, positive=True)
        g = scratch_grads(grads)
        part = torch.empty(batch, cdiv(numel, config.chunk), device=device)
        scratch_out = torch.empty_like(out)
        return bench_ms(
            lambda: _prep8_launch(codes, scales, g, None, mu, nesterov, scratch_out, part, config)
        )

    # Every candidate inside compiling_ahead (``Tuner.choices``): the caller's alignment.
    partial = None  # shaped by the config: one partial sum a program
    for config in TUNER.choices(
        "muon_prep8", key, PREP_CONFIGS, PREP_INTERPRETER_CONFIG, device, bench
    ):
        partial = torch.empty(batch, cdiv(numel, config.chunk), device=device)
        _prep8_launch(
            m_codes, m_scales, grads, grad_index, mu, bool(nesterov), out, partial, config
        )
    if partial is None:  # the first block of ``compile_then_tune``: no config chosen yet
        return out, sumsq  # (its second launches the winner, then the row sum)
    # Adds only: no contraction to choose, named so that no Triton default applies.
    _row_sum_kernel[(batch,)](
        partial, sumsq, partial.shape[1], BLOCK=SUM_BLOCK, enable_fp_fusion=False
    )
    return out, sumsq


# ----------------------------------------------------------------------------- torch


def muon_prep8_reference(
    m_codes: Sequence[Tensor],
    m_scales: Sequence[Tensor],
    grads: Sequence[Tensor],
    **prep: Unpack[PrepKeywords],
) -> tuple[Tensor, Tensor]:
    """``muon_prep_reference`` (its keywords) on dequantized momentum, requantized after."""
    pairs = list(zip(m_codes, m_scales, strict=True))
    momentums = [dequantize(mc, ms, "momentum") for mc, ms in pairs]
    out, sumsq = muon_prep_reference(momentums, grads, **prep)
    for (mc, ms), m in zip(pairs, momentums, strict=True):
        requantize_(mc, ms, m, "momentum")
    return out, sumsq
