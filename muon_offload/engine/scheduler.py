"""The stream scheduler: moves each chunk's state host -> device, lets the caller update it,
and writes it back, with the three stages of consecutive chunks overlapped.

    h2d stream      load 0 | load 1 | load 2 | load 3 | ...
    compute stream         | upd 0  | upd 1  | upd 2  | upd 3 ...
    d2h stream                      | store 0| store 1| store 2 ...

It owns its streams, events and staging buffers, all created once and reused. Ordering is by
events only (no host sync inside a step): a chunk's update waits for its load, its store waits
for its update, and a staging slot is loaded again only after its previous store finished.
Without a CUDA device the same code runs with plain copies and no streams, so CI tests the
logic of the pipeline. A step captured as a CUDA graph (``graphs.py``) runs this same code under
capture: the side streams fork from the capturing stream and join back into it.
"""

from __future__ import annotations

import time
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


def plan_transfer(
    tensors: Sequence[Tensor], base_of: Callable[[Tensor], Tensor] = _own_bytes
) -> Transfer:
    """Merge tensors that are adjacent in host memory (up to alignment padding) into runs.

    ``base_of(t)`` is a uint8 tensor that holds ``t`` (the host slab); tensors merge only
    within one base. Each run lands in staging at an offset with the same residue modulo
    ALIGN_BYTES as its host address, so every tensor keeps its host alignment on the device.
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
        )
        if not contiguous:
            close_run()
            run_start, run_base = addr, base
            run_offset = align_up(cursor) + addr % ALIGN_BYTES
        run_end = addr + nbytes
        views.append((run_offset + addr - run_start, t.shape, t.dtype))
    close_run()
    return Transfer(tuple(runs), tuple(views), align_up(cursor))


class StreamScheduler:
    """Runs chunks through load -> update -> store with a ring of staging buffers."""

    def __init__(self, device: torch.device, ring: int = 3):
        if ring < 2:
            raise ValueError(f"the staging ring needs at least 2 buffers, got {ring}")
        self.device = torch.device(device)
        self.ring = ring
        self.cuda = self.device.type == "cuda"
        self._staging: list[Tensor] = []
        self._staging_bytes = 0
        # Each streamed chunk's views and run slices of its staging slot, for the
        # ``transfers`` of the last ``run`` (the optimizer passes the same list while its plan
        # holds): rebuilt when the transfers or the staging buffers change.
        self._views_for: Sequence[Transfer | None] | None = None
        self._view_cache: dict[int, tuple[tuple[Tensor, ...], tuple]] = {}
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)
            make_events = lambda: [torch.cuda.Event() for _ in range(ring)]  # noqa: E731
            self._loaded, self._updated, self._stored = make_events(), make_events(), make_events()
            self._stored_once = [False] * ring
        # When set to a list, each step appends (chunk, stage, start, end) per chunk and stage
        # ("load", "update", "store"): CUDA events on the GPU, perf_counter seconds on the CPU.
        # None (default) records nothing. ``timeline_rows`` turns it into milliseconds.
        self.timeline: list | None = None

    @property
    def staging_bytes(self) -> int:
        return self._staging_bytes * len(self._staging)

    def reserve(self, nbytes: int, slots: int) -> None:
        """Size the ring for the largest chunk (and no more slots than there are chunks);
        reallocates only when it must grow."""
        slots = min(self.ring, max(slots, 1))
        if nbytes <= self._staging_bytes and slots <= len(self._staging):
            return
        nbytes = max(nbytes, self._staging_bytes)
        slots = max(slots, len(self._staging))
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()  # old slots may be in flight
        self._staging = []  # drop the old buffers before taking new ones
        self._staging = [
            torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(slots)
        ]
        self._staging_bytes = nbytes
        self._view_cache.clear()
        if self.cuda:
            self._stored_once = [False] * self.ring

    def prepare(self, transfers: Sequence[Transfer | None]) -> list[int]:
        """Size the ring for ``transfers`` (``run`` does it too; a graph's key reads the
        staging buffers after it); return the streamed chunks' indices."""
        streamed = [i for i, t in enumerate(transfers) if t is not None]
        self.reserve(max((t.nbytes for t in transfers if t is not None), default=0), len(streamed))
        if transfers is not self._views_for:
            self._views_for = transfers
            self._view_cache.clear()
        return streamed

    @property
    def staging_buffers(self) -> tuple[Tensor, ...]:
        return tuple(self._staging)

    def forget_events(self) -> None:
        """Drop the waits on earlier steps' stores, around a CUDA graph capture: waits inside a
        capture may only name events recorded in it. Safe: a step's first loads already follow
        the previous step's stores, since ``run`` ends with the compute stream waiting for the
        store stream and starts with the load stream waiting for the compute stream; a graph's
        replays run in order on one stream, so each one's loads follow the last one's stores."""
        if self.cuda:
            self._stored_once = [False] * self.ring

    def _views(self, chunk: int, slot: int, transfer: Transfer) -> tuple[Tensor, ...]:
        return self._staged(chunk, slot, transfer)[0]

    def _copies(self, chunk: int, slot: int, transfer: Transfer) -> tuple[tuple[Tensor, Tensor]]:
        """(host bytes, staging bytes) of each run of the chunk: what its load and store copy."""
        return self._staged(chunk, slot, transfer)[1]

    def _staged(self, chunk: int, slot: int, transfer: Transfer):
        """The chunk's tensor views and run slices in its staging slot, made once per
        ``transfers`` and staging ring (slicing costs microseconds a call, chunks a step)."""
        staged = self._view_cache.get(chunk)
        if staged is None:
            buf = self._staging[slot]
            views = tuple(
                buf[off : off + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for off, shape, dtype in transfer.views
            )
            runs = tuple(
                (run.host, buf[run.offset : run.offset + run.host.numel()]) for run in transfer.runs
            )
            staged = self._view_cache[chunk] = (views, runs)
        return staged

    def run(
        self,
        transfers: Sequence[Transfer | None],
        update: Callable[[int, Sequence[Tensor] | None], None],
    ) -> None:
        """For each chunk i: load ``transfers[i]``, call ``update(i, views)``, store it back.

        ``None`` marks a resident chunk: ``update(i, None)`` runs on its state in place.
        ``views`` are the same tensors at every ``run`` of the same ``transfers``: read them,
        never change them.
        """
        streamed = self.prepare(transfers)
        slot_of = {chunk: k % len(self._staging) for k, chunk in enumerate(streamed)}
        if not self.cuda:
            for i, transfer in enumerate(transfers):
                if transfer is None:
                    update(i, None)
                    continue
                slot = slot_of[i]
                copies = self._copies(i, slot, transfer)
                marks = self._mark(i, "load", None)
                for host, staged in copies:
                    staged.copy_(host)
                self._end_mark(marks, None)
                marks = self._mark(i, "update", None)
                update(i, self._views(i, slot, transfer))
                self._end_mark(marks, None)
                marks = self._mark(i, "store", None)
                for host, staged in copies:
                    host.copy_(staged)
                self._end_mark(marks, None)
            return

        compute = torch.cuda.current_stream(self.device)
        # Loads may start once everything queued so far on the compute stream (this step's
        # gradients, the previous step's updates) is done with the staging buffers.
        self.h2d_stream.wait_stream(compute)
        self.d2h_stream.wait_stream(compute)
        try:
            self._run_streams(transfers, update, streamed, slot_of, compute)
        finally:
            # Also after an error: what follows on the compute stream sees every stored chunk.
            # Both side streams join back, so that a capture of the step (graphs.py) ends with
            # no stream left forked, even when no chunk is streamed.
            compute.wait_stream(self.d2h_stream)
            compute.wait_stream(self.h2d_stream)

    def _run_streams(self, transfers, update, streamed, slot_of, compute) -> None:
        next_load = 0
        if streamed:
            self._load(streamed[0], slot_of[streamed[0]], transfers)
            next_load = 1
        for i, transfer in enumerate(transfers):
            if transfer is None:
                update(i, None)
                continue
            slot = slot_of[i]
            if next_load < len(streamed):
                ahead = streamed[next_load]
                self._load(ahead, slot_of[ahead], transfers)
                next_load += 1
            compute.wait_event(self._loaded[slot])
            marks = self._mark(i, "update", compute)
            update(i, self._views(i, slot, transfer))
            self._end_mark(marks, compute)
            self._updated[slot].record(compute)
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(self._updated[slot])
                marks = self._mark(i, "store", self.d2h_stream)
                for host, staged in self._copies(i, slot, transfer):
                    host.copy_(staged, non_blocking=True)
                self._end_mark(marks, self.d2h_stream)
                self._stored[slot].record(self.d2h_stream)
                self._stored_once[slot] = True

    def _load(self, chunk: int, slot: int, transfers: Sequence[Transfer | None]) -> None:
        with torch.cuda.stream(self.h2d_stream):
            if self._stored_once[slot]:
                # The slot's previous chunk must be written back (and so done being
                # updated) before new bytes land in it.
                self.h2d_stream.wait_event(self._stored[slot])
            marks = self._mark(chunk, "load", self.h2d_stream)
            for host, staged in self._copies(chunk, slot, transfers[chunk]):
                staged.copy_(host, non_blocking=True)
            self._end_mark(marks, self.h2d_stream)
            self._loaded[slot].record(self.h2d_stream)

    def _mark(self, chunk: int, stage: str, stream):
        if self.timeline is None:
            return None
        if not self.cuda:
            self.timeline.append([chunk, stage, time.perf_counter(), None])
            return self.timeline[-1]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        self.timeline.append((chunk, stage, start, end))
        return end

    def _end_mark(self, end, stream) -> None:
        if end is None:
            return
        if self.cuda:
            end.record(stream)
        else:
            end[3] = time.perf_counter()

    def timeline_rows(self, marks: list) -> list[dict]:
        """``timeline`` marks as rows of ms from the earliest start (synchronize first)."""
        if not marks:
            return []
        if self.cuda:
            ref = marks[0][2]
            rows = [(c, s, ref.elapsed_time(a), ref.elapsed_time(b)) for c, s, a, b in marks]
        else:
            rows = [(c, s, a * 1e3, b * 1e3) for c, s, a, b in marks]
        t0 = min(r[2] for r in rows)
        return [
            {"chunk": c, "stage": s, "start_ms": a - t0, "end_ms": b - t0} for c, s, a, b in rows
        ]
