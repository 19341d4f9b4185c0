"""The stream scheduler: moves each chunk's state host -> device, lets the caller update it,
and writes it back, the stages of consecutive chunks overlapped, the updates in two lanes.

    h2d stream        load 0 | load 1 | load 2 | load 3 | load 4 | ...
    compute stream           | upd 0 (Muon) ...........| upd 3 (Muon) ...
    side stream                       | upd 1 | upd 2 |         | upd 4
    d2h stream                                         | store 0 | store 1 | store 2 | ...

The main lane (the caller's current stream, the *compute* stream) runs the chunks that hold
matrix units (Muon's): compute-bound updates, and collectives that must run in plan order on
every rank. The side lane (a side stream) runs the chunks marked ``side``, the plan's
element-wise-only ones (``planner.elementwise_only``): their memory-bound updates overlap the
matrix products. ``side_lane=False``: one lane. Loads run in plan order on the one h2d stream,
stores of both lanes in plan order on the one d2h stream: the copy engine that writes to the
host runs the copies of every stream about in the order they become ready, so a side lane's
store on a stream of its own ran behind every main store queued before it was ready, and the
load that waited for its bytes with it (on the H200, a Qwen3-MoE step with a third of its
state loaded ahead took 106 ms against 83 with one store stream: docs/benchmarks.md, "One
store stream"). In plan order, a load waits only for stores the engine runs before those of
the chunks it needs next.

Streams, events and the staging arena are the scheduler's, created once. Ordering is by events
only (no host sync inside a step): its streams first wait for what the compute stream has
queued (the step's gradients and scalar table, the previous step); a chunk's update waits for
its load, its store for its update (on whichever stream ran it), a load for the stores of the
earlier chunks whose staging bytes it overwrites, piece by piece (each piece of it for the
chunk that held those bytes last: stores run in order). At the end the compute stream waits for
the updates (side stream and loads), not for the stores, which finish under what the caller
queues next (the forward): the next run's loads, loads queued ahead of it (``prefetch()``) and
every host reader of the state wait for them instead (``prefetch.py``); after an error or under
a graph capture it waits for every stream the step used. An update runs with its lane's stream
current: its kernels, pointer table uploads and temporaries are queued and allocated there (the
caching allocator reuses a block after the work of the stream that took it). What the side lane
and the stores read of other streams outlives its use: the arena (recorded on every stream of
the scheduler, and freed after a device sync), parameters, gradients and the scalar table
(blocks of the compute stream, whose later work follows the join).

Staging is one device buffer (the arena) of ``ring`` x the largest chunk (rounded up to
ARENA_ALIGN) in which the streamed chunks of a step take byte ranges one after another,
wrapping to the start when the next one would not fit (``place``): loads run ahead as far as
bytes allow, not a fixed count of chunks (a ring of three slots held a 128 MiB AdamW chunk in
a slot sized to a 224 MiB Muon matrix). Without a CUDA device the same code runs with plain
copies and no streams, in plan order, so CI tests the logic of the pipeline. A step captured
as a CUDA graph (``graphs.py``) runs it under capture: the scheduler's streams fork from the
capturing stream and join back into it, and every wait names an event of the same step (the
capture starts after a device sync); captured apart from its first loads and last stores
(``graph_ends.py``), it takes the first and leaves the last out (``prefetch.Split``). Chunk
state travels as ``transfer.plan_transfer`` lays it out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import prefetch
from .host_slabs import ALIGN_BYTES, align_up
from .staged_views import StagedViews
from .timeline import end_stage, start_stage
from .transfer import Transfer, plan_transfer  # noqa: F401 (its users import it from here)

ARENA_ALIGN = 4096  # each chunk starts on it: a multiple of ALIGN_BYTES, so the residues
# plan_transfer gives runs modulo ALIGN_BYTES (the host alignment) hold in the arena too
assert ARENA_ALIGN % ALIGN_BYTES == 0


@dataclass(frozen=True)
class ArenaLayout:
    """Where each streamed chunk of a step lies in the arena, and what its load waits for."""

    offsets: tuple[int, ...]  # each chunk's first byte in the arena
    waits: tuple[tuple[int, ...], ...]  # earlier chunks whose stores the chunk's load must follow
    issue_after: tuple[int, ...]  # the latest of them (-1: none): its store queued, the whole
    # load can be (stores run in order)
    # Per chunk, its bytes by the chunk that held them last: (that chunk, -1 for bytes none
    # held; first byte, end, from the chunk's start), ordered by that chunk. Each piece of the
    # load waits for its own chunk's store, not for the latest: a 128 MiB load over four
    # small chunks starts when the first is stored.
    spans: tuple[tuple[tuple[int, int, int], ...], ...]


def place(sizes: Sequence[int], arena_bytes: int) -> ArenaLayout:
    """Lay chunks of ``sizes`` bytes (in run order) into an arena of ``arena_bytes``: each
    starts where the previous one ended, rounded up to ARENA_ALIGN, or at 0 when it would not
    fit before the end. A chunk's load waits for the latest earlier chunk holding each of its
    bytes; every earlier chunk that shares a byte with it is then ordered before it, directly
    or through that chunk's own load (its store follows its load). Pure: tested without a
    GPU.
    """
    offsets, waits, spans = [], [], []
    owners: list[tuple[int, int, int]] = []  # (start, end, chunk): the latest holder, disjoint
    cursor = 0
    for k, n in enumerate(sizes):
        if n > arena_bytes:
            raise ValueError(f"chunk {k} needs {n} staging bytes, the arena has {arena_bytes}")
        start = align_up(cursor, ARENA_ALIGN)
        if start + n > arena_bytes:
            start = 0
        end = start + n
        hit = [o for o in owners if o[0] < end and start < o[1]]
        waits.append(tuple(sorted({o[2] for o in hit})))
        held = sorted((max(s, start) - start, min(e, end) - start, j) for s, e, j in hit)
        free, at = [], 0
        for lo, hi, _ in held:
            if at < lo:
                free.append((-1, at, lo))
            at = hi
        if at < n:
            free.append((-1, at, n))
        spans.append(tuple(free + sorted((j, lo, hi) for lo, hi, j in held if lo < hi)))
        kept = [o for o in owners if not (o[0] < end and start < o[1])]
        for s, e, j in hit:  # the parts of overwritten ranges outside the new one stay theirs
            if s < start:
                kept.append((s, start, j))
            if e > end:
                kept.append((end, e, j))
        if n:
            kept.append((start, end, k))
        owners = kept
        offsets.append(start)
        cursor = end
    issue_after = tuple(max(w, default=-1) for w in waits)
    return ArenaLayout(tuple(offsets), tuple(waits), issue_after, tuple(spans))


class StreamScheduler:
    """Runs chunks through load -> update -> store, staged in one arena of device bytes.
    ``side_lane``: chunks marked ``side`` run on the side lane (False: all on the main lane)."""

    def __init__(self, device: torch.device, ring=3, side_lane=True, staging=None) -> None:
        if ring < 2:
            raise ValueError(f"the staging arena needs room for at least 2 chunks, got {ring}")
        self.device = torch.device(device)
        self.ring = ring  # the arena holds ``ring`` chunks of the largest size
        # staging(n): bytes the arena holds at least for a step streaming n (its chunks end to
        # end): the loads and stores that backward and forward hide (``Settings.staging_for``).
        self.staging: Callable[[int], int] | None = staging
        self.cuda = self.device.type == "cuda"
        self.side_lane = side_lane
        self._arena: Tensor | None = None
        # For the ``transfers`` and ``side`` of the last ``run`` (the same objects while the
        # optimizer's plan holds): each chunk's lane, the streamed chunks, their sizes, layout
        # and views and run slices in the arena; rebuilt when they or the arena change.
        self._views_for: Sequence[Transfer | None] | None = None
        self._side_for: Sequence[bool] | None = None
        self._on_side: tuple[bool, ...] = ()  # by chunk index
        self._streamed: list[int] = []
        self._position: dict[int, int] = {}  # chunk index -> its place among the streamed
        self._sizes: list[int] = []
        self._layout: ArenaLayout | None = None
        self._views = StagedViews()  # and what the algorithms keep of them (``chunk_memo``)
        # One (loaded, updated, stored) event each a streamed chunk, grown with the plans.
        self._loaded: list = []
        # A load queued in part, by its place k: (next piece, last holder waited for, marks).
        self._loading: dict[int, tuple] = {}
        self._updated: list = []
        self._stored: list = []
        self.ahead = prefetch.Ahead()  # loads queued ahead of the next run, and the
        # last run's stores where the compute stream did not wait for them (prefetch.py)
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)
            if side_lane:
                self.side_stream = torch.cuda.Stream(self.device)
        # When set to a list, each step appends (chunk, stage, start, end) per chunk and stage
        # ("load", "update", "store"): CUDA events on the GPU, perf_counter seconds on the CPU.
        # None (default) records nothing. ``timeline.stage_rows`` turns it into milliseconds.
        self.timeline: list | None = None

    @property
    def staging_bytes(self) -> int:
        return self._arena.numel() if self._arena is not None else 0

    def reserve(self, nbytes: int, slots: int, at_least: int = 0) -> None:
        """Size the arena for ``slots`` chunks (at most ``ring``) of up to ``nbytes`` each, and
        ``at_least`` bytes; reallocates only when it must grow."""
        need = min(self.ring, max(slots, 1)) * align_up(nbytes, ARENA_ALIGN)
        need = max(need, align_up(at_least, ARENA_ALIGN))
        if self._arena is not None and need <= self._arena.numel():
            return
        if self.cuda and self._arena is not None:
            # The old arena may be in flight (loads, updates, stores of earlier steps, on
            # whichever stream ran them).
            torch.cuda.synchronize(self.device)
        self._views.clear()  # they hold the old arena
        self._layout = None
        self._arena = None  # freed before the new one is taken
        self._arena = torch.empty(need, dtype=torch.uint8, device=self.device)
        if self._arena.is_cuda:  # freed, it waits for these too: the compute stream does not
            for stream in self._forked(True):  # wait for the stores (prefetch.py)
                self._arena.record_stream(stream)

    def prepare(
        self, transfers: Sequence[Transfer | None], side: Sequence[bool] | None = None
    ) -> list[int]:
        """Put the chunks in lanes, size the arena and lay ``transfers`` out in it (``run`` does
        it too; a graph's key reads the arena after it); return the streamed chunks' indices."""
        if transfers is not self._views_for or side is not self._side_for:
            if side is not None and len(side) != len(transfers):
                raise ValueError(f"side marks {len(side)} chunks, the step has {len(transfers)}")
            self._views_for, self._side_for = transfers, side
            on = self.cuda and self.side_lane and side is not None  # the CPU path: plan order
            self._on_side = tuple(on and bool(side[i]) for i in range(len(transfers)))
            self._streamed = [i for i, t in enumerate(transfers) if t is not None]
            self._position = {i: k for k, i in enumerate(self._streamed)}
            self._sizes = [transfers[i].nbytes for i in self._streamed]
            self._layout = None
            self._views.clear()
        end_to_end = sum(align_up(n, ARENA_ALIGN) for n in self._sizes)
        at_least = self.staging(end_to_end) if self.staging is not None else 0
        self.reserve(max(self._sizes, default=0), len(self._sizes), at_least)
        if self._layout is None:
            self._layout = place(self._sizes, self.staging_bytes)
            if self.cuda:
                for events in (self._loaded, self._updated, self._stored):
                    events.extend(torch.cuda.Event() for _ in range(len(self._sizes) - len(events)))
        return self._streamed

    @property
    def staging_buffers(self) -> tuple[Tensor, ...]:
        return () if self._arena is None else (self._arena,)

    @property
    def layout(self) -> ArenaLayout | None:
        """The arena layout of the last prepared ``transfers``."""
        return self._layout

    def chunk_memo(self, chunk: int) -> dict:
        """A dict for the chunk's units to keep what they derive from its views (matrices cut
        from them: ``UnitJob.memo``), as long as the views stay the same: emptied with them,
        so that nothing kept holds an arena that a new one replaced."""
        return self._views.memo(chunk)

    def _staged(self, chunk: int) -> tuple[tuple[Tensor, ...], tuple]:
        """The chunk's tensor views and (host bytes, arena bytes) of each run in the arena,
        made once per ``transfers`` and arena."""
        base = self._layout.offsets[self._position[chunk]]
        return self._views.of(chunk, self._views_for[chunk], self._arena, base)

    def run(
        self,
        transfers: Sequence[Transfer | None],
        update: Callable[[int, Sequence[Tensor] | None], None],
        side: Sequence[bool] | None = None,
    ) -> None:
        """For each chunk i: load ``transfers[i]``, call ``update(i, views)``, store it back.

        ``None`` marks a resident chunk: ``update(i, None)`` runs on its state in place.
        ``views`` are the same tensors at every ``run`` of the same ``transfers``: read them,
        never change them. ``side[i]``: chunk i may run on the side lane (it issues no
        collective, shares no byte with another chunk). ``update`` is called in plan order,
        with the stream it runs on current."""
        self.prepare(transfers, side)
        if not self.cuda:
            ahead = prefetch.take(self, transfers, side, False)
            for i, transfer in enumerate(transfers):
                if transfer is None:
                    update(i, None)
                    continue
                views, copies = self._staged(i)
                if self._position[i] >= ahead:  # else loaded by ``prefetch.issue``
                    self._load(self._position[i], i)
                marks = self._mark(i, "update", None)
                update(i, views)
                end_stage(marks, None)
                if prefetch.defer(self, self._position[i], i):
                    continue
                marks = self._mark(i, "store", None)
                for host, staged in copies:
                    host.copy_(staged)
                end_stage(marks, None)
            return

        compute = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        joined = forked = self._forked(any(self._on_side))
        # Loads start after what the compute stream queued (and the last run's stores:
        # ``prefetch.take``); side updates after this step's gradients and scalar table.
        for stream in forked:
            stream.wait_stream(compute)
        ahead = prefetch.take(self, transfers, side, capturing)
        try:
            self._run_streams(transfers, update, compute, ahead)
            prefetch.stores_end(self)  # a held tail's stores follow them
            if self.ahead.leave and not capturing:  # the stores finish under what follows
                joined = prefetch.leave_stores(self, forked)
        finally:
            # Also after an error: what follows sees every update and store, and a capture
            # (graphs.py) ends with no stream left forked, even when no chunk is streamed. A
            # load left in part (an error) is loaded afresh by whatever loads it next.
            self._loading.clear()
            for stream in joined:
                compute.wait_stream(stream)

    def _forked(self, side: bool) -> list:
        """The streams a run forks: h2d, d2h, and with ``side`` the side lane's."""
        lane = [self.side_stream] if side and self.side_lane else []
        return [self.h2d_stream, self.d2h_stream, *lane]

    def _run_streams(self, transfers, update, compute, next_load: int) -> None:
        """``next_load``: the streamed chunks loaded ahead of the run (``prefetch.take``)."""
        streamed = self._streamed
        unordered = next_load if self.ahead.split else 0  # head graph loads: no events

        def issue(stored: int) -> None:
            """Queue, in order, the pieces of loads whose waits name only stores already queued
            (chunks up to ``stored``): as far ahead as the arena's bytes allow."""
            nonlocal next_load
            while next_load < len(streamed) and self._load(next_load, streamed[next_load], stored):
                next_load += 1

        issue(-1)
        for i, transfer in enumerate(transfers):
            side = self._on_side[i]
            stream = self.side_stream if side else compute
            with torch.cuda.stream(stream) if side else contextlib.nullcontext():
                if transfer is None:
                    update(i, None)
                    continue
                k = self._position[i]
                # Chunk k's load is queued: its waits name chunks before k, all stored by now.
                views, copies = self._staged(i)
                if k >= unordered:
                    stream.wait_event(self._loaded[k])
                marks = self._mark(i, "update", stream)
                update(i, views)
                end_stage(marks, stream)
                self._updated[k].record(stream)
            if prefetch.defer(self, k, i, stream):  # to the held tail: no load waits for it
                continue
            d2h = self.d2h_stream  # both lanes' stores, in plan order (the module's docstring)
            with torch.cuda.stream(d2h):
                d2h.wait_event(self._updated[k])
                marks = self._mark(i, "store", d2h)
                for host, staged in copies:
                    host.copy_(staged, non_blocking=True)
                end_stage(marks, d2h)
                self._stored[k].record(d2h)
            issue(k)

    def _load(self, k: int, chunk: int, stored: int | None = None) -> bool:
        """Queue the k-th streamed chunk's load (``chunk``) on the h2d stream, or copy it at
        once (CPU), piece by piece (``ArenaLayout.spans``), each after the store of the chunk
        whose bytes it takes (and so after that chunk's update): the pieces whose stores are
        queued (chunks up to ``stored``; None: all). Return whether the whole load is: its end
        follows the latest store of its bytes, as the update that waits for it must."""
        h2d = self.h2d_stream if self.cuda else None
        runs, spans = self._staged(chunk)[1], self._layout.spans[k]
        pieces = self._views.loads(chunk, self._views_for[chunk], runs, spans)
        at, waited, marks = self._loading.pop(k, (0, -1, None))
        latest = self._layout.issue_after[k]
        with torch.cuda.stream(h2d):  # None: no stream switched
            while at <= len(pieces):
                holder, copies = pieces[at] if at < len(pieces) else (latest, ())
                if stored is not None and holder > stored:
                    self._loading[k] = (at, waited, marks)
                    return False
                if h2d and holder > waited:  # stores run in order: one wait a holder
                    h2d.wait_event(self._stored[holder])
                    waited = holder
                if marks is None:
                    marks = self._mark(chunk, "load", h2d)
                for host, staged in copies:
                    staged.copy_(host, non_blocking=self.cuda)
                at += 1
            end_stage(marks, h2d)
            if h2d:
                self._loaded[k].record(h2d)
        return True

    def _mark(self, chunk: int, stage: str, stream):
        return start_stage(self.timeline, chunk, stage, stream, self.cuda)
