"""Fused AdamW and Lion on 8-bit state (the format: quant_maps.py), any number of segments.
Their torch references (the same math on dequantized state, requantized after; the CPU path)
are in quantized_elementwise_reference.py.

Like elementwise.py's kernels, each program updates one chunk of one segment, read through a
pointer table of rows ``[p, g, codes, scales, ..., start, count]`` (``_launch.py``; ``g``, a
row of a table of gradient addresses: ``GradIndex``); a segment starts on a block boundary of
its parameter, so chunks (multiples of ``QBLOCK``) cut no block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._grad_index import grad_index_for
from ._launch import (
    ALIGN_BYTES,
    TUNER,
    Config,
    bench_ms,
    bucket,
    check_scalars,
    dtype_name,
    scratch_like,
)
from ._triton import tl, triton
from .config import chunked
from .elementwise import (
    _adamw_hyper,
    _adamw_step,
    _launch_group,
    _lion_hyper,
    _lion_step,
    _segment,
    _typed,
    adamw_scalars,
    launcher_of,
    lion_scalars,
)
from .quant_maps import (
    _INV127,
    _INV255,
    _QB,
    _SALT_M,
    _SALT_V,
    QBLOCK,
    _block_tile,
    _ld,
    _load_state,
    _store_state,
    check_segments,
)
from .quantized_elementwise_reference import adamw8_reference_, lion8_reference_

# Tile = block elements ([block / QBLOCK, QBLOCK] as a 2-D tile), chunk elements a program;
# both multiples of QBLOCK. Candidates around the fp32 kernels' measured best (elementwise.py).
CONFIGS = chunked(
    (2048, 16384, 8), (1024, 16384, 4), (4096, 16384, 8), (2048, 65536, 8), (1024, 4096, 4)
)
# Two blocks a tile, two tiles a program: small tests cover full tiles, the masked tail and
# several programs.
INTERPRETER_CONFIG = Config(block=2 * QBLOCK, chunk=4 * QBLOCK, num_warps=4)


# ----------------------------------------------------------------------------- Triton


@triton.jit
def _state_ptrs(row, index, CODE: tl.constexpr, start, ALIGNED: tl.constexpr):
    """An 8-bit state's codes and scales pointers at element ``start`` (a multiple of QBLOCK):
    entries ``index`` and ``index + 1`` of a pointer-table row."""
    codes = _typed(row, index, CODE, start, ALIGNED)
    return codes, _typed(row, index + 1, tl.float32, start // _QB, False)


@triton.jit
def _step8_tile(
    p_ptr,
    g_ptr,
    mc_ptr,
    ms_ptr,
    vc_ptr,  # the variance's codes and scales (ADAMW); Lion's kernel passes m's, unread
    vs_ptr,
    start,
    count,
    hyper,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    CAUTIOUS: tl.constexpr,
    ADAMW: tl.constexpr,  # AdamW's step on m and v, else Lion's on its momentum m
):
    M_POWER: tl.constexpr = 4 if ADAMW else 2  # adam_m's map, else momentum's (one salt)
    offs, i_b, col = _block_tile(start, BLOCK)
    mask = offs < count if MASKED else None
    bmask = i_b * _QB < count if MASKED else None
    p = _ld(p_ptr + offs, mask, MASKED).to(tl.float32)
    g = _ld(g_ptr + offs, mask, MASKED).to(tl.float32)
    m = _load_state(mc_ptr, ms_ptr, offs, i_b, mask, bmask, MASKED, M_POWER, _INV127)
    if ADAMW:
        v = _load_state(vc_ptr, vs_ptr, offs, i_b, mask, bmask, MASKED, 4, _INV255)
        p, m, v = _adamw_step(p, g, m, v, hyper, CAUTIOUS)
    else:
        p, m = _lion_step(p, g, m, hyper, CAUTIOUS)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    _store_state(
        m, mc_ptr, ms_ptr, offs, i_b, col, mask, bmask, M_POWER, 127, _INV127, True, _SALT_M
    )
    if ADAMW:
        _store_state(
            v, vc_ptr, vs_ptr, offs, i_b, col, mask, bmask, 4, 255, _INV255, False, _SALT_V
        )


@triton.jit
def _step8_chunk(
    ptrs, count, hyper, BLOCK: tl.constexpr, CAUTIOUS: tl.constexpr, ADAMW: tl.constexpr
):
    """A program's chunk, ``_step8_tile`` on each tile (``ptrs``: its six pointers)."""
    n_full = count // BLOCK
    for i_t in range(n_full):  # full tiles: no mask, so accesses stay 16 bytes wide
        _step8_tile(*ptrs, i_t * BLOCK, count, hyper, BLOCK, False, CAUTIOUS, ADAMW)
    if n_full * BLOCK < count:
        _step8_tile(*ptrs, n_full * BLOCK, count, hyper, BLOCK, True, CAUTIOUS, ADAMW)


@triton.jit
def _adamw8_kernel(
    table,  # [programs, 8] int64: p, g, m codes, m scales, v codes, v scales, start, count
    grads,  # int64 gradient addresses (GradIndex.table): the table's g is a row of it
    scalars,  # fp32 [7]: adamw_scalars' values, read from memory (a CUDA graph replays them)
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    CAUTIOUS: tl.constexpr,  # dion's cautious_wd (elementwise.py's ``_decayed``)
):
    # start: a multiple of the chunk, so of QBLOCK
    row, start, count, p_ptr, g_ptr = _segment(table, grads, 8, P_DTYPE, G_DTYPE, ALIGNED)
    mc_ptr, ms_ptr = _state_ptrs(row, 2, tl.int8, start, ALIGNED)
    vc_ptr, vs_ptr = _state_ptrs(row, 4, tl.uint8, start, ALIGNED)
    hyper = _adamw_hyper(scalars)
    ptrs = (p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr)
    _step8_chunk(ptrs, count, hyper, BLOCK, CAUTIOUS, True)


@triton.jit
def _lion8_kernel(
    table,  # [programs, 6] int64: p, g, m codes, m scales, start, count
    grads,  # int64 gradient addresses (GradIndex.table): the table's g is a row of it
    scalars,  # fp32 [4]: 1 - beta1, 1 - beta2, 1 - lr * weight_decay, lr (lion_scalars)
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    CAUTIOUS: tl.constexpr,  # dion's cautious_wd (elementwise.py's ``_decayed``)
):
    row, start, count, p_ptr, g_ptr = _segment(table, grads, 6, P_DTYPE, G_DTYPE, ALIGNED)
    mc_ptr, ms_ptr = _state_ptrs(row, 2, tl.int8, start, ALIGNED)
    hyper = _lion_hyper(scalars)
    # The tile takes a second moment's pair (AdamW's v) too; ADAMW=False never reads it, so
    # the momentum's pair stands in for it.
    _step8_chunk(
        (p_ptr, g_ptr, mc_ptr, ms_ptr, mc_ptr, ms_ptr), count, hyper, BLOCK, CAUTIOUS, False
    )


# ----------------------------------------------------------------------------- launchers


def _launch_segments(kernel, name, params, grads, states, scalars, index, cautious) -> None:
    """Checks the segments, then launches once per (param dtype, grad dtype, 16-byte alignment)
    group of them. ``states``: (name, codes, scales, map kind) per state. Scales need 4-byte
    alignment only; the others are read 16 bytes at a time when aligned. The gradients are
    read through ``index`` (``_launch.grad_index_for``)."""
    numels = check_segments(params, grads, states)
    if not numels:
        return
    lists = (params, grads, *(ts for _, codes, scales, _ in states for ts in (codes, scales)))
    device = lists[0][0].device
    grad_table, grad_rows = grad_index_for(grads, index)
    groups: dict[tuple, list[int]] = {}
    for i in range(len(numels)):
        aligned = all(
            lists[j][i].data_ptr() % ALIGN_BYTES == 0
            for j in range(len(lists))
            if j < 2 or j % 2 == 0
        )
        groups.setdefault((lists[0][i].dtype, lists[1][i].dtype, aligned), []).append(i)
    for (p_dtype, g_dtype, aligned), members in groups.items():
        ptrs = [tuple(lists[j][i].data_ptr() for i in members) for j in range(len(lists))]
        ptrs[1] = tuple(grad_rows[i] for i in members)  # the table holds the gradients' rows
        ptrs = tuple(ptrs)
        sizes = tuple(numels[i] for i in members)
        dtypes = (p_dtype, g_dtype)

        def launch(ptrs, grad_table, config, aligned=aligned, sizes=sizes, dtypes=dtypes):
            # Products rounded before sums, as the torch reference: codes match it bit for bit
            # on the GPU too (a fused multiply-add can move a rounding).
            args = (ptrs, grad_table, sizes, dtypes, scalars, config, aligned, cautious)
            _launch_group(kernel, name, device, *args, fp_fusion=False)

        def bench(config, members=members, launch=launch):
            scratch = []
            for j, tensors in enumerate(lists):
                group = [tensors[i] for i in members]
                if j >= 2 and j % 2 == 0:  # codes: random bytes
                    scratch.append([torch.randint_like(t, 0, 100) for t in group])
                elif j >= 2:  # scales
                    scratch.append(scratch_like(group, positive=True))
                else:
                    scratch.append(scratch_like(group))
            ptrs = [tuple(t.data_ptr() for t in col) for col in scratch]
            scratch_table, ptrs[1] = grad_index_for(scratch[1], None)
            return bench_ms(lambda: launch(tuple(ptrs), scratch_table, config))

        key = (dtype_name(p_dtype), dtype_name(g_dtype), bucket(sum(sizes)), bucket(len(sizes)))
        # Every candidate inside compiling_ahead (``Tuner.choices``).
        for config in TUNER.choices(name, key, CONFIGS, INTERPRETER_CONFIG, device, bench):
            launch(ptrs, grad_table, config)


def adamw8_from_(
    params,
    grads,
    m_codes,
    m_scales,
    v_codes,
    v_scales,
    scalars: Tensor,
    grad_index=None,
    cautious_wd: bool = False,
) -> None:
    """``adamw8_`` with its runtime scalars (``adamw_scalars``' seven, fp32) read on the
    device from ``scalars`` (the engine's step table); ``grad_index``: where the gradients'
    addresses are read (``_launch.GradIndex``; None: theirs)."""
    if params:
        check_scalars(scalars, 7, params[0].device)
    states = [("m_codes", m_codes, m_scales, "adam_m"), ("v_codes", v_codes, v_scales, "adam_v")]
    args = (params, grads, states, scalars, grad_index, cautious_wd)
    _launch_segments(_adamw8_kernel, "adamw8", *args)


def lion8_from_(
    params, grads, m_codes, m_scales, scalars: Tensor, grad_index=None, cautious_wd=False
) -> None:
    """``lion8_`` with its runtime scalars (``lion_scalars``' four, fp32) read from ``scalars``,
    its gradients through ``grad_index`` (as ``adamw8_from_``)."""
    if params:
        check_scalars(scalars, 4, params[0].device)
    states = [("m_codes", m_codes, m_scales, "momentum")]
    args = (params, grads, states, scalars, grad_index, cautious_wd)
    _launch_segments(_lion8_kernel, "lion8", *args)


adamw8_ = launcher_of(
    adamw8_reference_,
    adamw8_from_,
    adamw_scalars,
    """Fused AdamW on 8-bit state (``adam_m`` / ``adam_v`` maps), any number of segments;
    ``adamw8_reference_``'s arguments and math. Each segment starts on a block boundary of its
    parameter; its scales hold ceil(numel / QBLOCK) entries.""",
)
lion8_ = launcher_of(
    lion8_reference_,
    lion8_from_,
    lion_scalars,
    """Fused Lion on 8-bit momentum (``momentum`` map); ``lion8_reference_``'s arguments and
    math.""",
)
