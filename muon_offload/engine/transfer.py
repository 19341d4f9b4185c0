"""How one chunk's state travels between the host slabs and the staging arena: its tensors
merged into contiguous runs of host bytes, and where each lands in the chunk's staging bytes
(``plan_transfer``, made once per plan; the scheduler copies the runs).

A run spans the padding between two tensors, never a byte of another tensor of the step
(``plan_transfers``): a chunk's store writes back every byte of its runs, so a run over a piece
of another chunk (the 8-bit scales of one matrix of a stack, lying between the codes and scales
of the next) wrote back the bytes it loaded over that chunk's update whenever it loaded before
that chunk's store (its load waits only for the stores whose staging bytes it takes).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .host_slabs import ALIGN_BYTES, align_up


@dataclass(frozen=True)
class _Run:
    """A contiguous byte range of host memory copied as one piece."""

    host: Tensor  # uint8 view of the host bytes
    offset: int  # byte offset of the run inside a staging buffer


@dataclass(frozen=True)
class Transfer:
    """How one chunk's state travels: the copies, and where each tensor lands on device."""

    runs: tuple[_Run, ...]
    views: tuple[tuple[int, torch.Size, torch.dtype], ...]  # (staging byte offset, shape, dtype)
    nbytes: int  # staging bytes this chunk needs


def _byte_view(t: Tensor) -> tuple[int, int]:
    """(address, byte length) of a contiguous tensor."""
    if not t.is_contiguous():
        raise ValueError("state tensors moved by the scheduler must be contiguous")
    return t.data_ptr(), t.numel() * t.element_size()


def _own_bytes(t: Tensor) -> Tensor:
    """The uint8 view of ``t``'s whole storage (the default base of ``plan_transfer``)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),))


def plan_transfers(
    chunks: Sequence[Sequence[Tensor] | None], base_of: Callable[[Tensor], Tensor] = _own_bytes
) -> list[Transfer | None]:
    """``plan_transfer`` of each chunk's tensors (None: a chunk that is not streamed), no run
    spanning a byte of any tensor of any of them."""
    starts = sorted(_byte_view(t)[0] for ts in chunks if ts for t in ts if t.numel())
    return [None if ts is None else plan_transfer(ts, base_of, starts) for ts in chunks]


def _free(starts: Sequence[int] | None, start: int, end: int) -> bool:
    """Whether no tensor starts in [start, end) (tensors are disjoint: none spans ``start``,
    where the run's last tensor ends)."""
    if starts is None:
        return True
    i = bisect.bisect_left(starts, start)
    return i == len(starts) or starts[i] >= end


def plan_transfer(
    tensors: Sequence[Tensor],
    base_of: Callable[[Tensor], Tensor] = _own_bytes,
    starts: Sequence[int] | None = None,
) -> Transfer:
    """Merge tensors that are adjacent in host memory (up to alignment padding) into runs.

    ``base_of(t)`` is a uint8 tensor that holds ``t`` (the host slab); tensors merge only
    within one base, and, with ``starts`` (the sorted addresses of every tensor that other
    runs may move, ``plan_transfers``), only over padding: no tensor starts in between. Each
    run lands in staging at an offset with the same residue modulo ALIGN_BYTES as its host
    address, so every tensor keeps its host alignment on the device.
    """
    runs: list[_Run] = []
    views: list[tuple[int, torch.Size, torch.dtype]] = []
    run_start = run_end = run_offset = run_base = None
    cursor = 0

    def close_run():
        nonlocal cursor
        if run_start is not None:
            at = run_start - run_base.data_ptr()
            runs.append(_Run(run_base[at : at + run_end - run_start], run_offset))
            cursor = run_offset + (run_end - run_start)

    for t in tensors:
        addr, nbytes = _byte_view(t)
        if nbytes == 0:  # an empty shard: nothing to move, an empty view on the device
            views.append((0, t.shape, t.dtype))
            continue
        base = base_of(t)
        contiguous = (
            run_start is not None
            and base.data_ptr() == run_base.data_ptr()
            and 0 <= addr - run_end < ALIGN_BYTES
            and _free(starts, run_end, addr)
        )
        if not contiguous:
            close_run()
            run_start, run_base = addr, base
            run_offset = align_up(cursor) + addr % ALIGN_BYTES
        run_end = addr + nbytes
        views.append((run_offset + addr - run_start, t.shape, t.dtype))
    close_run()
    return Transfer(tuple(runs), tuple(views), align_up(cursor))
