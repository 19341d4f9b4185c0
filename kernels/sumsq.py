"""Each matrix's sum of squares, added in one order fixed by the matrix's size alone.

The orthogonalizer divides every matrix by its norm, so the bits of a Muon update depend on
the bits of this sum. The Muon prep kernel (``muon.py``) sums the bf16 values it stores;
``sum_squares`` here sums a batch that arrives without it (a sharded matrix gathered whole,
packed row blocks). Both add in the same order, whatever the batch size, the launch
configuration or the compiler's register layout:

1. the matrix's storage is cut into groups of ``SUMSQ_CHUNK`` elements (the last one short);
2. in a group, lane ``l`` of ``SUMSQ_BLOCK`` lanes adds the squares of elements
   ``l, l + BLOCK, l + 2 BLOCK, ...`` in turn (missing elements add +0, which is exact);
3. the lanes are added pairwise, neighbours first (``tree_sum``): a sum of two numbers is
   the same whichever is first, so the result does not depend on which thread holds what,
   as ``tl.sum`` over many elements would (its order follows the layout, i.e. num_warps);
4. the groups' partial sums: lane ``l`` of ``lanes = min(MAX_ROW_LANES,
   next_power_of_2(groups))`` adds partials ``l, l + lanes, ...`` in turn, then the lanes
   pairwise (``sum_partials``, which runs ``MAX_ROW_LANES`` lanes: the ones past ``lanes``
   hold exact zeros, so the sum is the same bit for bit).

Squares are accumulated without fused multiply-adds (``enable_fp_fusion=False``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._launch import cdiv, interpreted, launch_batched
from ._triton import tl, triton

SUMSQ_BLOCK = 2048
SUMSQ_CHUNK = 32768
LOG2_SUMSQ_BLOCK = 11
MAX_ROW_LANES = 1024


@triton.jit
def tree_sum(x, LOG2: tl.constexpr):
    """Sum of x [2^LOG2] fp32, neighbours added pairwise: the order is x's index order only."""
    for _ in tl.static_range(LOG2):
        x = tl.sum(tl.reshape(x, (x.shape[0] // 2, 2)), axis=1)
    return tl.sum(x, axis=0)


@triton.jit(do_not_specialize=("b_start", "groups"))
def _sumsq_partial_kernel(
    u,  # [B, numel], each matrix's storage contiguous
    partial,  # [B, groups] fp32
    b_start,
    numel,
    groups,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64) + b_start
    start = i_c * CHUNK
    base = u + i_b * numel + start
    count = tl.minimum(numel - start, CHUNK)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    n_full = count // BLOCK
    for i_t in range(n_full):
        v = tl.load(base + i_t * BLOCK + offs).to(tl.float32)
        acc += v * v
    tail = count - n_full * BLOCK
    if tail > 0:
        mask = offs < tail
        v = tl.load(base + n_full * BLOCK + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.where(mask, v * v, 0.0)
    tl.store(partial + i_b * groups + i_c, tree_sum(acc, LOG2_BLOCK))


@triton.jit(do_not_specialize=("groups",))
def _sum_rows_kernel(partial, out, groups, LANES: tl.constexpr, LOG2_LANES: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, LANES)
    acc = tl.zeros([LANES], dtype=tl.float32)
    for s in range(0, groups, LANES):
        acc += tl.load(partial + i_b * groups + s + offs, mask=s + offs < groups, other=0.0)
    tl.store(out + i_b, tree_sum(acc, LOG2_LANES))


def groups_for(numel: int) -> int:
    return cdiv(numel, SUMSQ_CHUNK)


def sum_partials(partial: Tensor, out: Tensor) -> Tensor:
    """out [B] fp32 = each row of partial [B, groups] (contiguous) summed in the fixed order."""
    batch, groups = partial.shape
    if batch == 0:
        return out
    _sum_rows_kernel[(batch,)](
        partial,
        out,
        groups,
        # Always the most lanes: zero lanes add exactly nothing, so the sum is that of
        # next_power_of_2(groups) lanes bit for bit, and one compiled kernel serves every
        # size (sumsq is non-negative or NaN: + 0.0 changes neither).
        LANES=MAX_ROW_LANES,
        LOG2_LANES=MAX_ROW_LANES.bit_length() - 1,
        num_warps=4,
        enable_fp_fusion=False,  # adds only: nothing to fuse, and no default to depend on
    )
    return out


def flat_matrices(t: Tensor) -> Tensor | None:
    """[B, numel] view of a batch whose matrices each occupy one contiguous run of memory
    (row-major, or the ``.mT`` view of a row-major batch), else None."""
    b, m, n = t.shape
    if t.is_contiguous() or t.mT.is_contiguous():
        base = t if t.is_contiguous() else t.mT
        return base.reshape(b, m * n)
    return None


def sum_squares(u: Tensor) -> Tensor:
    """[B] fp32: each matrix's sum of squares, in the order above (over its storage, so a
    ``.mT`` view sums as the row-major batch it views). Kernels on CUDA and under the
    interpreter; batches that are not one run per matrix, or CPU tensors otherwise, get
    ``sum_squares_reference``."""
    if u.ndim != 3:
        raise ValueError(f"expected a batch [B, m, n], got shape {tuple(u.shape)}")
    flat = flat_matrices(u)
    if flat is None or not (u.is_cuda or interpreted()):
        return sum_squares_reference(u)
    batch, numel = flat.shape
    out = torch.empty(batch, dtype=torch.float32, device=u.device)
    if numel == 0:
        return out.zero_()
    groups = groups_for(numel)
    partial = torch.empty(batch, groups, dtype=torch.float32, device=u.device)
    launch_batched(
        _sumsq_partial_kernel,
        groups,
        batch,
        (flat, partial),
        numel,
        groups,
        BLOCK=SUMSQ_BLOCK,
        CHUNK=SUMSQ_CHUNK,
        LOG2_BLOCK=LOG2_SUMSQ_BLOCK,
        num_warps=8,
        enable_fp_fusion=False,
    )
    return sum_partials(partial, out)


def sum_squares_reference(u: Tensor) -> Tensor:
    """The plain torch sum (its order is torch's, not the one above)."""
    return u.float().square().sum(dim=(-2, -1))
