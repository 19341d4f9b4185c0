"""Element-wise optimizer updates: AdamW (torch.optim.AdamW numerics) and Lion (dion's rule).

Every function updates lists of tensors in place. Index ``i`` of each list is one segment:
a parameter (or a contiguous slice of one), its gradient and its state, all with the same
number of elements. Math runs in fp32; each stored tensor is rounded once, on store.

``adamw_`` and ``lion_`` launch one Triton kernel per dtype combination (usually one per
call). Each program updates one chunk of one segment, read through a pointer table of rows
``[p, g, m, (v,) start, count]`` (``g``: a row of a table of gradient addresses, ``GradIndex``;
see ``_launch.py``). ``adamw_reference_`` and ``lion_reference_`` (elementwise_reference.py) are
the plain-torch versions (CPU path, and what the kernels are tested against).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ParamSpec

import numpy as np
import torch
from torch import Tensor

from ._grad_index import GradIndex, grad_index_for
from ._launch import (
    ALIGN_BYTES,
    FP_FUSION,
    TABLES,
    TUNER,
    Config,
    bench_ms,
    bucket,
    check_lists,
    check_scalars,
    chunk_rows,
    device_scalars,
    dtype_name,
    group_by_dtype,
    scratch_like,
    triton_dtype,
)
from ._triton import tl, triton
from .config import chunked
from .elementwise_reference import adamw_reference_, adamw_scalars, lion_reference_, lion_scalars

P = ParamSpec("P")  # a reference's parameters, which its launcher takes (``launcher_of``)

# Candidates timed by the tuner (block elements per tile, chunk elements per program).
# 256 MiB of fp32 AdamW state is 32 Mi elements: a 16 Ki chunk gives 2048 programs, about
# 15 per SM of an H200, enough to hide the tail of the last wave.
CONFIGS = chunked(
    (1024, 16384, 4),
    (2048, 16384, 8),
    (4096, 16384, 8),
    (2048, 65536, 8),
    (1024, 4096, 4),
    (4096, 65536, 16),
)
# The interpreter runs each program instance in numpy (about 3 ms each): small tiles keep
# the full-tile loop and the masked tail both exercised by small test tensors.
INTERPRETER_CONFIG = Config(block=256, chunk=1024, num_warps=4)


@triton.jit
def _lerp(start, end, weight):
    # torch.lerp's formula, so fp32 results match torch's to the rounding of each operation.
    diff = end - start
    return tl.where(weight < 0.5, start + weight * diff, end - diff * (1.0 - weight))


@triton.jit
def _decayed(p, u, decay, CAUTIOUS: tl.constexpr):
    """p (1 - lr wd); with CAUTIOUS (dion's cautious_wd), only where the update u and p agree
    in sign (u p >= 0), p unchanged elsewhere: ``elementwise_reference.cautious_decay``."""
    if CAUTIOUS:
        decay = tl.where(u * p >= 0, decay, 1.0)
    return p * decay


@triton.jit
def _typed(row, index, DTYPE: tl.constexpr, start, ALIGNED: tl.constexpr):
    # Addresses read from a table carry no alignment facts: without the hint there are no
    # 16-byte accesses (checked in the PTX: ld.global.v4.b32 with it, ld.global.b32 without).
    ptr = tl.load(row + index).to(tl.pointer_type(DTYPE)) + start
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _segment(
    table,
    grads,
    WIDTH: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """This program's row of a pointer table ``[p, g, ..., start, count]`` of WIDTH entries:
    (row, start, count, p and g pointers at start; g through its row of ``grads``)."""
    row = table + tl.program_id(0).to(tl.int64) * WIDTH
    start = tl.load(row + (WIDTH - 2))
    count = tl.load(row + (WIDTH - 1))
    p_ptr = _typed(row, 0, P_DTYPE, start, ALIGNED)
    g_ptr = _typed(grads, tl.load(row + 1), G_DTYPE, start, ALIGNED)  # a row of grads
    return row, start, count, p_ptr, g_ptr


@triton.jit
def _adamw_hyper(scalars):
    """adamw_scalars' seven values, read from memory (a CUDA graph replays new ones)."""
    return (
        tl.load(scalars),  # 1 - beta1 (lerp weight)
        tl.load(scalars + 1),  # beta2
        tl.load(scalars + 2),  # 1 - beta2
        tl.load(scalars + 3),  # eps
        tl.load(scalars + 4),  # 1 - lr * weight_decay
        tl.load(scalars + 5),  # lr / (1 - beta1^step)
        tl.load(scalars + 6),  # sqrt(1 - beta2^step)
    )


@triton.jit
def _lion_hyper(scalars):
    """lion_scalars' four values: 1 - beta1, 1 - beta2, 1 - lr * weight_decay, lr."""
    return (tl.load(scalars), tl.load(scalars + 1), tl.load(scalars + 2), tl.load(scalars + 3))


@triton.jit
def _adamw_step(p, g, m, v, hyper, CAUTIOUS: tl.constexpr):
    """One AdamW step on fp32 values -> (p, m, v): the rule of the fp32 and the 8-bit kernels
    (quantized_elementwise.py), whatever their state is stored as."""
    w1, beta2, omb2, eps, decay, step_size, bc2_sqrt = hyper
    m = _lerp(m, g, w1)
    v = v * beta2 + (g * g) * omb2
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = _decayed(p, m, decay, CAUTIOUS) - step_size * tl.div_rn(m, denom)
    return p, m, v


@triton.jit
def _lion_step(p, g, m, hyper, CAUTIOUS: tl.constexpr):
    """One Lion step on fp32 values -> (p, m), as ``_adamw_step``."""
    w1, w2, decay, lr = hyper
    u = _lerp(m, g, w1)
    sign = tl.where(u > 0, 1.0, tl.where(u < 0, -1.0, 0.0))
    sign = tl.where(u != u, u, sign)  # NaN stays NaN, as torch.sign
    m = _lerp(m, g, w2)
    p = _decayed(p, sign, decay, CAUTIOUS) - lr * sign
    return p, m


@triton.jit
def _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, hyper, CAUTIOUS: tl.constexpr):
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p, m, v = _adamw_step(p, g, m, v, hyper, CAUTIOUS)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(
    table,  # [programs, 6] int64: p address, g row in grads, m, v addresses, start, count
    grads,  # int64: gradient addresses (GradIndex.table)
    scalars,  # fp32 [7]: adamw_scalars' values (read from memory: a CUDA graph replays new ones)
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    M_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    CAUTIOUS: tl.constexpr,  # dion's cautious_wd (``_decayed``)
):
    row, start, count, p_ptr, g_ptr = _segment(table, grads, 6, P_DTYPE, G_DTYPE, ALIGNED)
    m_ptr = _typed(row, 2, M_DTYPE, start, ALIGNED)
    v_ptr = _typed(row, 3, V_DTYPE, start, ALIGNED)
    hyper = _adamw_hyper(scalars)
    offs = tl.arange(0, BLOCK)
    n_full = count // BLOCK
    for i_t in range(n_full):  # full tiles: no mask, so loads stay 16 bytes wide
        _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, i_t * BLOCK + offs, None, hyper, CAUTIOUS)
    tail = count - n_full * BLOCK
    if tail > 0:
        tail_offs, tail_mask = n_full * BLOCK + offs, offs < tail
        _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, tail_offs, tail_mask, hyper, CAUTIOUS)


@triton.jit
def _lion_tile(p_ptr, g_ptr, m_ptr, offs, mask, hyper, CAUTIOUS: tl.constexpr):
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    p, m = _lion_step(p, g, m, hyper, CAUTIOUS)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lion_kernel(
    table,  # [programs, 5] int64: p address, g row in grads, m address, start, count
    grads,  # int64: gradient addresses (GradIndex.table)
    scalars,  # fp32 [4]: lion_scalars' values (read from memory, as the AdamW kernel's)
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    M_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    CAUTIOUS: tl.constexpr,  # dion's cautious_wd (``_decayed``)
):
    row, start, count, p_ptr, g_ptr = _segment(table, grads, 5, P_DTYPE, G_DTYPE, ALIGNED)
    m_ptr = _typed(row, 2, M_DTYPE, start, ALIGNED)
    hyper = _lion_hyper(scalars)
    offs = tl.arange(0, BLOCK)
    n_full = count // BLOCK
    for i_t in range(n_full):
        _lion_tile(p_ptr, g_ptr, m_ptr, i_t * BLOCK + offs, None, hyper, CAUTIOUS)
    tail = count - n_full * BLOCK
    if tail > 0:
        tail_offs, tail_mask = n_full * BLOCK + offs, offs < tail
        _lion_tile(p_ptr, g_ptr, m_ptr, tail_offs, tail_mask, hyper, CAUTIOUS)


def _launch_segments(
    kernel, name: str, lists, scalars, index: GradIndex | None, cautious: bool = False
) -> None:
    """Launch ``kernel`` over parallel segment lists (gradients through ``index``): one launch
    per combination of dtypes and 16-byte alignment. Alignment is a compile-time promise for
    the whole launch, so one unaligned segment must not take 16-byte accesses away from the
    others: measured on the H200, 104 segments of 32 Mi elements ran 0.35 ms with one odd
    offset among them against 0.23 ms all aligned."""
    numels = check_lists([name] * len(lists), lists)
    if not numels:
        return
    ptrs = [[t.data_ptr() for t in tensors] for tensors in lists]
    aligned = [not any(col[i] % ALIGN_BYTES for col in ptrs) for i in range(len(numels))]
    grad_table, ptrs[1] = grad_index_for(lists[1], index)  # the table holds the gradients' rows
    groups = group_by_dtype(lists)
    device = lists[0][0].device
    if len(groups) == 1 and all(aligned):  # the usual case: one launch over everything
        ((dtypes, _),) = groups.items()
        for config in _choose(kernel, name, lists, numels, dtypes, scalars, cautious):
            args = (ptrs, grad_table, numels, dtypes, scalars, config, True, cautious)
            _launch_group(kernel, name, device, *args)
        return
    for dtypes, members in groups.items():
        for flag in (True, False):
            part = [i for i in members if aligned[i] == flag]
            if not part:
                continue
            group = [[tensors[i] for i in part] for tensors in lists]
            sizes = [numels[i] for i in part]
            part_ptrs = [[col[i] for i in part] for col in ptrs]
            for config in _choose(kernel, name, group, sizes, dtypes, scalars, cautious):
                args = (part_ptrs, grad_table, sizes, dtypes, scalars, config, flag, cautious)
                _launch_group(kernel, name, device, *args)


def _launch_group(
    kernel,
    name,
    device,
    ptrs,
    grad_table,
    sizes,
    dtypes,
    scalars,
    config,
    aligned,
    cautious,
    fp_fusion=FP_FUSION,
) -> None:
    """One launch over segments given by their addresses (``ptrs[j][i]``: tensor j of
    segment i; the gradients' rows of ``grad_table`` at j = 1) and element counts, the
    kernel's dtypes (``dtypes``: torch's) after its three pointers (dense and 8-bit)."""
    ptrs = tuple(tuple(col) for col in ptrs)
    key = (name, device.index, config.chunk, ptrs, tuple(sizes))

    def build():
        return chunk_rows(
            np.array(ptrs, dtype=np.int64).T.reshape(len(sizes), len(ptrs)),
            np.array(sizes, dtype=np.int64),
            config.chunk,
        )

    table = TABLES.get(key, build, device)
    if table.shape[0] == 0:
        return
    kernel[(table.shape[0],)](
        table,
        grad_table,
        scalars,
        *(triton_dtype(d) for d in dtypes),
        BLOCK=config.block,
        ALIGNED=aligned,
        CAUTIOUS=cautious,
        num_warps=config.num_warps,
        enable_fp_fusion=fp_fusion,
    )


def _choose(kernel, name, group, sizes, dtypes, scalars, cautious) -> tuple[Config, ...]:
    """The configs to launch with (``Tuner.choices``: every candidate inside compiling_ahead,
    where the bench's aligned scratch does not compile an unaligned group's variant)."""
    device = group[0][0].device
    key = (",".join(dtype_name(d) for d in dtypes), bucket(sum(sizes)), bucket(len(sizes)))

    def bench(config: Config) -> float:
        # Scratch copies of the call's tensors: the real ones are updated exactly once.
        scratch = [scratch_like(tensors, positive=(j == 3)) for j, tensors in enumerate(group)]
        ptrs = [[t.data_ptr() for t in tensors] for tensors in scratch]
        aligned = not any(p % ALIGN_BYTES for col in ptrs for p in col)
        grad_table, ptrs[1] = grad_index_for(scratch[1], None)
        args = (ptrs, grad_table, sizes, dtypes, scalars, config, aligned, cautious)
        return bench_ms(lambda: _launch_group(kernel, name, device, *args))

    return TUNER.choices(name, key, CONFIGS, INTERPRETER_CONFIG, device, bench)


def _on(tensors: Sequence[Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def adamw_from_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    scalars: Tensor,
    grad_index: GradIndex | None = None,
    cautious_wd: bool = False,
) -> None:
    """``adamw_`` with its runtime scalars read on the device from ``scalars``: fp32, the
    seven values of ``adamw_scalars`` in order (the engine's step table: what a CUDA graph
    replays with each step's values). ``grad_index``: where the kernel reads the gradients'
    addresses (the engine's step table of them; ``_launch.GradIndex``), None for theirs."""
    if params:
        check_scalars(scalars, 7, params[0].device)
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    _launch_segments(_adamw_kernel, "adamw", lists, scalars, grad_index, cautious_wd)


def lion_from_(
    params: Sequence[Tensor],
    grads,
    exp_avgs,
    scalars: Tensor,
    grad_index: GradIndex | None = None,
    cautious_wd: bool = False,
) -> None:
    """``lion_`` with its runtime scalars (``lion_scalars``' four, fp32) read from ``scalars``,
    its gradients through ``grad_index`` (as ``adamw_from_``)."""
    if params:
        check_scalars(scalars, 4, params[0].device)
    lists = (params, grads, exp_avgs)
    _launch_segments(_lion_kernel, "lion", lists, scalars, grad_index, cautious_wd)


def launcher_of(
    reference: Callable[P, None],
    from_: Callable[..., None],
    scalars_of: Callable[..., tuple[float, ...]],
    doc: str,
) -> Callable[P, None]:
    """The launcher that takes ``reference``'s arguments (segment lists, ``cautious_wd`` and the
    hyper-parameters as Python numbers) and runs ``from_`` with the hyper-parameters' runtime
    scalars (``scalars_of(**hyper)``) as a device tensor (``device_scalars``: one per value):
    the four launchers of the fp32 and 8-bit AdamW and Lion kernels."""

    def launch(*lists, cautious_wd: bool = False, **hyper) -> None:
        scalars = device_scalars(scalars_of(**hyper), _on(lists[0]))
        from_(*lists, scalars, cautious_wd=cautious_wd)

    launch.__name__ = launch.__qualname__ = from_.__name__.removesuffix("from_")
    launch.__doc__ = doc
    launch.__wrapped__ = reference  # what ``inspect.signature`` shows: the reference's arguments
    return launch


adamw_ = launcher_of(
    adamw_reference_,
    adamw_from_,
    adamw_scalars,
    """Fused AdamW over any number of segments of any sizes; ``adamw_reference_``'s arguments
    and math. Hyper-parameters are runtime values: changing them never recompiles
    (``cautious_wd``, a compile-time flag, does).""",
)
lion_ = launcher_of(
    lion_reference_,
    lion_from_,
    lion_scalars,
    """Fused Lion over any number of segments of any sizes; ``lion_reference_``'s arguments and
    math.""",
)
