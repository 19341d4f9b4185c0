"""The staging arena (engine/scheduler.py) without a GPU: where chunks are placed and what each
load waits for (``place``), the scheduler's stream code run on stand-in streams and events (every
pair of chunks that share arena bytes ordered, waits naming only events of their own step), and
steps with chunks of mixed sizes bitwise equal to resident ones."""

import contextlib
import random

import pytest
import torch
from _mixed_runs import assert_bitwise, mixed_run

from muon_offload.engine.host_slabs import ALIGN_BYTES, align_up
from muon_offload.engine.scheduler import (
    ARENA_ALIGN,
    StreamScheduler,
    Transfer,
    place,
    plan_transfer,
)
from muon_offload.engine.staged_views import StagedViews
from muon_offload.engine.transfer import plan_transfers

MIB = 1 << 20


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _check_layout(sizes, arena):
    layout = place(sizes, arena)
    ranges = [(o, o + n) for o, n in zip(layout.offsets, sizes, strict=True)]
    before: list[set[int]] = []  # chunks whose stores each chunk's load follows
    holder = [-1] * (arena // ALIGN_BYTES)  # the last chunk to hold each ALIGN_BYTES
    for k, (start, end) in enumerate(ranges):
        assert start % ARENA_ALIGN == 0 and start >= 0 and end <= arena, (k, start, end)
        # Its spans: every byte once, each with the chunk that held it last, by that chunk.
        spans = layout.spans[k]
        assert [h for h, _, _ in spans] == sorted(h for h, _, _ in spans)
        got = {}
        for h, lo, hi in spans:
            assert 0 <= lo < hi <= end - start, (k, spans)
            got.update({(start + b) // ALIGN_BYTES: h for b in range(lo, hi, ALIGN_BYTES)})
        units = range(start // ALIGN_BYTES, end // ALIGN_BYTES)
        assert len(got) == len(units) and got == {u: holder[u] for u in units}, k
        assert sum(hi - lo for _, lo, hi in spans) == end - start
        assert {h for h, _, _ in spans} - {-1} == (set(layout.waits[k]) if sizes[k] else set())
        for u in units:
            holder[u] = k
        waits = layout.waits[k]
        assert all(j < k and _overlap(ranges[j], ranges[k]) for j in waits), (k, waits)
        assert layout.issue_after[k] == max(waits, default=-1)
        # A load follows the stores it waits for, and (a store following its own load)
        # whatever those chunks' loads followed.
        before.append(set(waits).union(*(before[j] for j in waits)))
        for j in range(k):
            if _overlap(ranges[j], ranges[k]) and sizes[j] and sizes[k]:
                assert j in before[k], (j, k, ranges[j], ranges[k])
    return layout


@pytest.mark.parametrize("ring", [2, 3, 4])
def test_place_random_sizes(ring):
    rng = random.Random(ring)
    for _ in range(200):
        largest = rng.randrange(1, 64) * ALIGN_BYTES
        sizes = [rng.randrange(0, largest // ALIGN_BYTES + 1) * ALIGN_BYTES for _ in range(30)]
        sizes[rng.randrange(30)] = largest
        layout = _check_layout(sizes, ring * align_up(largest, ARENA_ALIGN))
        if ring >= 3:  # room for two of the largest beside any chunk: neighbours never collide
            assert all(k - 1 not in w for k, w in enumerate(layout.waits)), layout


def test_place_same_sizes_is_the_ring_of_three():
    layout = _check_layout([8192] * 7, 3 * 8192)
    assert layout.offsets == (0, 8192, 16384, 0, 8192, 16384, 0)
    assert layout.waits == ((), (), (), (0,), (1,), (2,), (3,))


def test_place_smaller_chunks_run_further_ahead():
    """A 224 MiB Muon chunk, then 128 MiB element-wise ones, in 3 x 224 MiB: three loads run
    while the first chunk updates (a ring of three slots let two run), and a load waits only
    for the stores whose bytes it takes."""
    sizes = [224 * MIB, 128 * MIB, 128 * MIB, 128 * MIB, 224 * MIB, 128 * MIB]
    layout = _check_layout(sizes, 3 * 224 * MIB)
    assert [o // MIB for o in layout.offsets] == [0, 224, 352, 480, 0, 224]
    assert layout.waits == ((), (), (), (), (0,), (1,))


def test_place_refuses_a_chunk_over_the_arena():
    with pytest.raises(ValueError, match="chunk 1 needs"):
        place([4096, 3 * 4096], 2 * 4096)


def _chunks(sizes, seed=0):
    """One host slab holding chunks of ``sizes`` fp32 elements, two tensors each (the second
    one starting on the next ALIGN_BYTES boundary), and their transfers."""
    gen = torch.Generator().manual_seed(seed)
    per = ALIGN_BYTES // 4
    spans, at = [], 0
    for n in sizes:
        a = at
        b = align_up(a + n // 2, per)
        spans.append(((a, a + n // 2), (b, b + n - n // 2)))
        at = align_up(b + n - n // 2, per)
    slab = torch.randn(at, generator=gen)
    tensors = [[slab[s:e] for s, e in pair] for pair in spans]
    return slab, tensors, [plan_transfer(ts) for ts in tensors]


def _update(i, views):
    for j, v in enumerate(views):
        v.mul_(1.5).add_(i + j)


def _expected(tensors):
    out = []
    for i, ts in enumerate(tensors):
        out.append([t.clone().mul_(1.5).add_(i + j) for j, t in enumerate(ts)])
    return out


def test_cpu_run_places_chunks_in_the_arena_and_grows_it_only_when_needed():
    sizes = [5000, 700, 64, 1300, 5000, 900, 2000, 3333, 100]
    slab, tensors, transfers = _chunks(sizes)
    want = _expected(tensors)
    sched = StreamScheduler(torch.device("cpu"))
    sched.run(transfers, _update)
    for got, exp in zip(tensors, want, strict=True):
        for a, b in zip(got, exp, strict=True):
            assert torch.equal(a, b)
    largest = max(t.nbytes for t in transfers)
    assert sched.staging_bytes == 3 * align_up(largest, ARENA_ALIGN)
    (arena,) = sched.staging_buffers
    for i, t in enumerate(transfers):
        views, _ = sched._staged(i)
        base = arena.data_ptr() + sched.layout.offsets[i]
        for v, host, (off, _, _) in zip(views, tensors[i], t.views, strict=True):
            assert v.data_ptr() == base + off
            # The host tensor's alignment, kept in the arena (plan_transfer's residues).
            assert (v.data_ptr() - arena.data_ptr()) % ALIGN_BYTES == host.data_ptr() % ALIGN_BYTES
    # Smaller chunks fit the arena as it is; a larger one grows it (and lays out afresh).
    smaller = _chunks([100, 200, 300, 400], seed=1)[2]
    sched.prepare(smaller)
    assert sched.staging_buffers[0] is arena
    larger = _chunks([20000, 100], seed=2)[2]
    sched.prepare(larger)
    assert sched.staging_bytes == 2 * align_up(larger[0].nbytes, ARENA_ALIGN)
    assert sched.layout.offsets == (0, align_up(larger[0].nbytes, ARENA_ALIGN))


class _Node:
    def __init__(self, log, deps, stream):
        self.index = len(log)
        self.deps = deps
        self.stream = stream  # the name of the stream that queued it
        log.append(self)


class _Stream:
    """Queued work as nodes: each follows the stream's previous node and what it waited for."""

    def __init__(self, log, name):
        self.log, self.name, self.last, self.waits = log, name, None, []

    def _add(self, extra=None):
        deps = [d for d in (self.last, extra) if d is not None]
        self.last = _Node(self.log, deps, self.name)
        return self.last

    def wait_event(self, event):
        assert event.node is not None, "a wait on an event never recorded"
        self.waits.append(self._add(event.node))
        self.waits[-1].event = event

    def wait_stream(self, other):
        self._add(other.last)

    def synchronize(self):
        pass


class _Event:
    def __init__(self, enable_timing=False, external=False):
        self.node = None
        self.external = external  # recorded or waited for as a graph's node (graph_ends.py)

    recorded: list = []  # the external events recorded, in order (graph stand-ins read it)

    def record(self, stream):
        self.node = stream._add()
        if self.external:
            _Event.recorded.append(self)

    def query(self):
        return True  # copies run at once on the stand-ins

    def synchronize(self):
        pass


class _Cuda:
    """Stand-ins for torch.cuda's streams and events, with a current stream that
    ``torch.cuda.stream`` switches, and schedulers that run their CUDA path on them (copies run
    at once on the CPU, in the order queued)."""

    def __init__(self, monkeypatch):
        self.log: list[_Node] = []
        self.compute = _Stream(self.log, "compute")
        self.current = self.compute
        self.capturing = False  # what torch.cuda.is_current_stream_capturing says
        monkeypatch.setattr(torch.cuda, "Event", _Event)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self._stream)

    @contextlib.contextmanager
    def _stream(self, stream):
        saved, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = saved

    def scheduler(self, **kwargs) -> StreamScheduler:
        sched = StreamScheduler(torch.device("cpu"), **kwargs)
        sched.cuda = True
        for name in ("h2d", "d2h", "side"):
            setattr(sched, f"{name}_stream", _Stream(self.log, name))
        return sched

    def streams(self, sched) -> list[_Stream]:
        return [self.compute] + [getattr(sched, f"{n}_stream") for n in ("h2d", "d2h", "side")]


def _before(a: _Node, b: _Node) -> bool:
    """Whether node ``a`` happens before node ``b``."""
    stack, seen = [b], set()
    while stack:
        n = stack.pop()
        if n is a:
            return True
        if n.index > a.index and id(n) not in seen:
            seen.add(id(n))
            stack.extend(n.deps)
    return False


def _run_steps(cuda, sched, transfers, side, steps=2):
    """Run ``steps`` steps of ``transfers`` (update i changes chunk i - 1's tensors as
    ``_expected`` does, a resident chunk 0 before them); check that each step's waits name only
    events recorded in it (what a CUDA graph capture needs; outside a capture, also the ends of
    the store streams the last step left running) and that every update ran with the
    stream that queued its marks current. Return per step the marks by (chunk, stage); each
    update's stream and the node it queued there (its kernel), by chunk; and a node queued on
    the compute stream before the step and one after."""
    out = []
    for _ in range(steps):
        marks, ran_on = [], {}
        for s in cuda.streams(sched):
            s.waits = []
        before = cuda.compute._add()  # the step's gradients
        start = len(cuda.log)
        sched.timeline = marks

        def update(i, views, ran_on=ran_on):
            ran_on[i] = (cuda.current.name, cuda.current._add())
            if views is not None:
                _update(i - 1, views)

        sched.run(transfers, update, side)
        after = cuda.compute._add()  # what follows the step
        left = () if cuda.capturing else ("d2h",)
        for s in cuda.streams(sched):  # events of this step only, or the last step's stores
            assert all(w.deps[-1].index >= start or w.deps[-1].stream in left for w in s.waits)
        step = {(c, stage): (a.node, b.node) for c, stage, a, b in marks}
        for c, (stream, _) in ran_on.items():
            if (c, "update") in step:
                assert step[c, "update"][0].stream == stream, (c, stream)
        out.append((step, ran_on, before, after))
    return out


class _Piece:
    """Arena bytes a load writes: each copy also queues a node on the current stand-in stream,
    noted with the chunk and the arena bytes it wrote."""

    def __init__(self, staged, arena, chunk, writes, cuda):
        self.staged, self.arena, self.chunk, self.writes, self.cuda = (
            staged,
            arena,
            chunk,
            writes,
            cuda,
        )

    def copy_(self, src, non_blocking=False):
        self.staged.copy_(src)
        lo = self.staged.data_ptr() - self.arena.data_ptr()
        self.writes.append((self.chunk, lo, lo + self.staged.numel(), self.cuda.current._add()))


def _arena_writes(monkeypatch, cuda, sched) -> list:
    """(chunk, first arena byte, end, node) of each piece of each load the scheduler queues."""
    writes = []
    real = StagedViews.loads

    def loads(views, chunk, transfer, runs, spans):
        arena = sched.staging_buffers[0]
        return tuple(
            (holder, tuple((h, _Piece(a, arena, chunk, writes, cuda)) for h, a in pieces))
            for holder, pieces in real(views, chunk, transfer, runs, spans)
        )

    monkeypatch.setattr(StagedViews, "loads", loads)
    return writes


@pytest.mark.parametrize("capturing", [False, True])
@pytest.mark.parametrize("ring", [2, 3])
@pytest.mark.parametrize("pattern", ["none", "alternate", "runs", "all"])
def test_stream_code_orders_every_chunk_that_shares_bytes(monkeypatch, ring, pattern, capturing):
    """The CUDA path on stand-in streams and events: the dependency graph it queues orders,
    within a step, each load after its own chunk's earlier sharers' stores (whichever lane
    stored them), each update after its load and each store after its update, and, across
    steps, every load after the last step's stores and updates; every update follows what the
    compute stream queued before the step, and what it queues after follows every update,
    and every store only under a graph capture (eager steps leave their stores running under
    what follows, prefetch.py). Chunks marked ``side`` (with ``pattern``; a resident one among
    them) update on the side stream, the others on the compute stream; every store is queued on
    the d2h stream, in plan order.
    Ring 2: neighbours share bytes, so a load is queued only after the store it waits for."""
    cuda = _Cuda(monkeypatch)
    cuda.capturing = capturing
    sizes = [5000, 700, 64, 1300, 5000, 900, 2000, 3333, 100, 5000, 64]
    slab, tensors, transfers = _chunks(sizes)
    want = _expected(_expected(tensors))
    transfers = [None] + transfers  # a resident chunk first
    n = len(transfers)
    side = {
        "none": None,
        "alternate": tuple(i % 2 == 0 for i in range(n)),
        "runs": tuple(i % 5 in (1, 2, 3) for i in range(n)),
        "all": (True,) * n,
    }[pattern]
    sched = cuda.scheduler(ring=ring)
    writes = _arena_writes(monkeypatch, cuda, sched)
    steps = _run_steps(cuda, sched, transfers, side)
    assert writes
    on_side = [bool(side and side[i]) for i in range(n)]
    layout = sched.layout
    ranges = [(o, o + size) for o, size in zip(layout.offsets, sched._sizes, strict=True)]
    for step, ran_on, before, after in steps:
        assert {i: s for i, (s, _) in ran_on.items()} == {
            i: "side" if on_side[i] else "compute" for i in range(n)
        }
        for _, kernel in ran_on.values():  # the resident chunk's too
            assert _before(before, kernel) and _before(kernel, after)
        for k in range(len(sizes)):
            c = k + 1
            assert step[c, "store"][0].stream == "d2h"
            if c > 1:  # in plan order, whichever lane updated them
                assert _before(step[c - 1, "store"][1], step[c, "store"][0])
            assert _before(step[c, "load"][1], step[c, "update"][0])
            assert _before(step[c, "update"][1], step[c, "store"][0])
            assert _before(before, step[c, "update"][0])
            assert _before(step[c, "update"][1], after)
            assert _before(step[c, "store"][1], after) == capturing or c < len(sizes) - 2
            for j in range(k):
                if _overlap(ranges[j], ranges[k]):  # the whole load, after each store
                    assert _before(step[j + 1, "store"][1], step[c, "load"][1]), (j, k)
            for chunk, lo, hi, node in writes:  # each of its pieces, after the stores of the
                if chunk == c and _before(before, node) and _before(node, after):  # bytes
                    for j in range(k):  # it takes
                        if _overlap(ranges[j], (lo, hi)):
                            assert _before(step[j + 1, "store"][1], node), (j, k, lo, hi)
            if ring == 3 and c > 1 and on_side[c] and not on_side[c - 1]:
                # Beside the Muon chunk before it: its update does not wait for that chunk's
                # (their bytes do not meet with a ring of three); its store follows that one's.
                assert not _before(step[c - 1, "update"][0], step[c, "update"][1]), c
    first, second = steps[0][0], steps[1][0]
    for _, a in steps[0][1].values():
        assert all(_before(a, b) for _, b in steps[1][1].values())
    for c in range(1, len(sizes) + 1):
        for d in range(1, len(sizes) + 1):
            assert _before(first[c, "store"][1], second[d, "load"][0])
            assert _before(first[c, "update"][1], second[d, "update"][0])
    # The copies ran at once, in the order queued: a valid order too, so the data is right.
    for got, exp in zip(tensors, want, strict=True):
        for a, b in zip(got, exp, strict=True):
            assert torch.equal(a, b)


def test_side_lane_off_and_no_side_chunks_fork_only_the_transfer_streams(monkeypatch):
    """``side_lane=False`` runs every chunk on the main lane, whatever ``side`` says; a step
    with no chunk on the side lane queues nothing on its streams (the step as before it)."""
    cuda = _Cuda(monkeypatch)
    slab, tensors, transfers = _chunks([700, 64, 1300])
    for sched, side in (
        (cuda.scheduler(side_lane=False), (True, False, True)),
        (cuda.scheduler(), (False, False, False)),
        (cuda.scheduler(), None),
    ):
        ((step, ran_on, _, _),) = _run_steps(cuda, sched, transfers, side, steps=1)
        assert {s for s, _ in ran_on.values()} == {"compute"}
        assert sched.side_stream.last is None


@pytest.mark.parametrize("pattern", ["alternate", "pairs"])
def test_a_load_waits_for_the_latest_store_it_needs_whichever_lane_updated_it(monkeypatch, pattern):
    """Ring 2: chunk 3 takes the bytes of chunks 0 and 1. Its load waits for one store, chunk
    1's, whichever lanes updated 0 and 1: every store is queued on the d2h stream in plan order
    (the copy engine runs a store of a stream of its own behind the other stream's queued
    ones), so chunk 1's store follows chunk 0's."""
    cuda = _Cuda(monkeypatch)
    sizes = [4096, 4096, 8192, 8192, 4096, 4096, 8192, 4096]
    transfers = [Transfer((), (), n) for n in sizes]
    side = tuple((i if pattern == "alternate" else i // 2) % 2 == 1 for i in range(len(sizes)))
    sched = cuda.scheduler(ring=2)
    ((step, _, _, _),) = _run_steps(cuda, sched, transfers, side, steps=1)
    assert sched.layout.waits[3] == (0, 1) and sched.layout.issue_after[3] == 1
    load_3 = step[3, "load"][0]
    assert [w for w in sched.h2d_stream.waits if _before(w, load_3)][-1].event is sched._stored[1]
    assert _before(step[0, "store"][1], step[1, "store"][0])
    assert {s.name for s in cuda.streams(sched) if s.last is not None} >= {"side", "d2h"}


def test_a_load_over_two_chunks_starts_when_the_first_is_stored(monkeypatch):
    """Ring 2: a later chunk takes the bytes of chunks 0 and 1. Its pieces over chunk 0's
    bytes are queued after chunk 0's store, not after chunk 1's (a 128 MiB load over four
    small chunks waited for the last of them, the copy engine idle meanwhile); those over
    chunk 1's bytes after chunk 1's; the load's end after both."""
    cuda = _Cuda(monkeypatch)
    slab, tensors, transfers = _chunks([1024, 1024, 2048, 2048, 1024], seed=3)
    want = _expected(tensors)
    sched = cuda.scheduler(ring=2)
    writes = _arena_writes(monkeypatch, cuda, sched)
    ((step, _, _, _),) = _run_steps(cuda, sched, [None, *transfers], None, steps=1)
    layout = sched.layout
    # Where it lands depends on the slab's address (the runs keep its residues): 2 or 3.
    (k,) = [k for k, w in enumerate(layout.waits) if w == (0, 1)]
    assert {h for h, _, _ in layout.spans[k]} - {-1} == {0, 1}
    pieces = [(lo, node) for c, lo, _, node in writes if c == k + 1]  # plan index: k + 1
    start = layout.offsets[k]
    spans = layout.spans[k]
    holders = [next(h for h, a, b in spans if a <= lo - start < b) for lo, _ in pieces]
    assert {0, 1} <= set(holders)
    stored = [step[c, "store"][1] for c in (1, 2)]  # plan index c: chunk c - 1
    for holder, (_, node) in zip(holders, pieces, strict=True):
        assert [_before(stored[0], node), _before(stored[1], node)] == [holder >= 0, holder == 1]
    assert _before(stored[1], step[k + 1, "load"][1])
    for got, exp in zip(tensors, want, strict=True):
        for a, b in zip(got, exp, strict=True):
            assert torch.equal(a, b)


def test_side_marks_one_a_chunk():
    sched = StreamScheduler(torch.device("cpu"))
    slab, tensors, transfers = _chunks([700, 64])
    with pytest.raises(ValueError, match="side marks 1 chunks, the step has 2"):
        sched.run(transfers, _update, (True,))


def test_an_error_on_the_side_lane_still_joins_every_stream(monkeypatch):
    """An update that raises on the side stream: the compute stream still waits for every
    stream the step forked (what it queues next follows every update and store queued)."""
    cuda = _Cuda(monkeypatch)
    slab, tensors, transfers = _chunks([700, 64, 1300, 900])
    sched = cuda.scheduler()
    marks = sched.timeline = []

    def update(i, views):
        if i == 2:
            raise RuntimeError("boom")
        _update(i, views)

    with pytest.raises(RuntimeError, match="boom"):
        sched.run(transfers, update, (True, False, True, True))
    after = cuda.compute._add()
    assert cuda.current is cuda.compute
    for s in cuda.streams(sched):
        assert s.last is after or _before(s.last, after), s.name
    assert {(c, stage) for c, stage, _, _ in marks} >= {(0, "store"), (1, "store")}


MIXED = [(48, 80)] * 5 + [(80, 48)] * 2 + [(1031,), (257, 13), (300,), (129,), (4099,)]


def test_mixed_chunk_sizes_in_flight_equal_resident_bitwise():
    """Muon matrices larger than chunk_bytes (chunks of their own) between small element-wise
    chunks: several chunks share the arena at once, and four steps equal the resident step
    bitwise."""
    gen = torch.Generator().manual_seed(11)
    init = [torch.randn(s, generator=gen) for s in MIXED]

    def run(**kwargs):
        return mixed_run(init, 7, 3, seed=900, **kwargs)

    off_params, off = run(offload=True, chunk_bytes=4000)
    res_params, res = run()
    layout = off._streams.scheduler.layout
    sizes = off._streams.scheduler._sizes
    assert len(set(sizes)) > 2, sizes
    # More chunks lie in the arena at once than a ring of three slots held.
    assert any(after < k - 3 for k, after in enumerate(layout.issue_after)), layout
    assert_bitwise((off_params, off), (res_params, res))


SIDE_SHAPES = [(40, 24)] * 2 + [(24, 40)] * 5 + [(1031,), (257, 13), (300,), (129,), (4099,)]


@pytest.mark.parametrize("resident_bytes", [None, 40000])
@pytest.mark.parametrize("side_lane", [True, False])
def test_optimizer_runs_elementwise_only_chunks_on_the_side_stream(
    monkeypatch, resident_bytes, side_lane
):
    """Muon, AdamW and Lion, offloaded (or partly resident), through the scheduler's CUDA
    path on stand-ins: the updates of the plan's element-wise-only chunks (``elementwise_only``,
    resident ones too) run with the side stream current, those of the chunks that hold Muon
    units (a resident one may hold element-wise units too) with the compute stream current;
    every chunk is called in plan order. Four steps equal the resident step bitwise."""
    from muon_offload.engine import optimizer as engine
    from muon_offload.engine.planner import elementwise_only, holds_matrices

    cuda = _Cuda(monkeypatch)
    ran = []
    real = engine.run_chunk

    def spy(ctx, layout, *args, **kwargs):
        ran.append((layout.chunk, cuda.current.name))
        return real(ctx, layout, *args, **kwargs)

    monkeypatch.setattr(engine, "run_chunk", spy)
    gen = torch.Generator().manual_seed(12)
    init = [torch.randn(s, generator=gen) for s in SIDE_SHAPES]

    def run(scheduler=None, **kwargs):
        return mixed_run(init, 7, 3, seed=700, scheduler=scheduler, **kwargs)

    res_params, res = run()
    ran.clear()
    kwargs = dict(offload=True, chunk_bytes=8000, resident_chunk_bytes=8000)
    if resident_bytes is not None:
        kwargs["resident_bytes"] = resident_bytes
    off_params, off = run(cuda.scheduler(side_lane=side_lane), **kwargs)
    plan = next(iter(off._plans.values()))[0]

    def kind(c):
        if not holds_matrices(c):
            return "e"
        return "M" if all(u.algorithm == "muon" for u in c.units) else "M+"

    kinds = " ".join(("r" if c.resident else "") + kind(c) for c in plan.chunks)
    # Streamed element-wise chunks (a streamed chunk holds one kind), resident element-wise
    # chunks when part of the state stays on the device.
    assert kinds.count("e") >= 5 and "M+" not in kinds.replace("rM+", ""), kinds
    assert ("re" in kinds) == (resident_bytes is not None), kinds
    want = [
        (c, "side" if side_lane and e else "compute")
        for c, e in zip(plan.chunks, elementwise_only(plan), strict=True)
    ]
    assert ran == want * 4
    assert_bitwise((off_params, off), (res_params, res))


def test_runs_span_padding_but_never_a_tensor_of_another_chunk():
    """``plan_transfers``: a chunk's run merges two of its tensors over the padding between
    them, not over a piece of another chunk lying there (its store would write back the bytes
    it loaded over that chunk's update)."""
    slab = torch.zeros(4 * ALIGN_BYTES, dtype=torch.uint8)
    mine, theirs = [slab[0:100], slab[ALIGN_BYTES : ALIGN_BYTES + 64]], [slab[100:140]]
    assert len(plan_transfer(mine).runs) == 1  # alone: one run over bytes 100..255
    split, none, other = plan_transfers([mine, None, theirs])
    assert none is None and len(split.runs) == 2 and len(other.runs) == 1
    assert [r.host.numel() for r in split.runs] == [100, 64]
    # Over padding only (their piece before mine): still one run.
    after = [slab[140:200], slab[ALIGN_BYTES : ALIGN_BYTES + 64]]
    assert len(plan_transfers([after, theirs])[0].runs) == 1


INT8_STACKS = [(64, 80), (64, 80), (40, 64), (2, 64, 80), (4500,), (4200,)]


@pytest.mark.parametrize("state_dtype", [None, torch.int8])
def test_tensors_cut_between_chunks_through_the_stream_code_equal_resident(
    monkeypatch, state_dtype
):
    """A stack cut by matrix and element-wise tensors cut in segments, through the CUDA path
    on stand-ins (copies run in the order queued: a load queued ahead runs before the stores of
    the chunks whose bytes it does not take). The 8-bit scales of one matrix of a stack lie in
    the padding between the codes and scales of the next: a run spanning them wrote the
    matrix's old scales back over its update. Two steps equal the resident ones bitwise."""
    cuda = _Cuda(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=gen) for s in INT8_STACKS]
    kwargs = dict(steps=2, state_dtype=state_dtype, backend="torch", cuda_graph=False)
    resident = mixed_run(init, 4, 1, seed=50, **kwargs)
    sched = cuda.scheduler()
    off = mixed_run(init, 4, 1, 50, scheduler=sched, offload=True, chunk_bytes=6000, **kwargs)
    assert_bitwise(off, resident)


def test_a_load_left_in_part_by_an_error_is_loaded_whole_next_time(monkeypatch):
    """Ring 2: when chunk 1's update raises, chunk 2's load over chunks 0 and 1 is queued in
    part (its piece over chunk 0's bytes). The run drops it: the next run loads chunk 2
    from its first piece, and its results are those of a run that never failed."""
    cuda = _Cuda(monkeypatch)
    slab, tensors, transfers = _chunks([1024, 1024, 2048, 2048, 1024], seed=4)
    want = _expected(tensors)
    sched = cuda.scheduler(ring=2)

    def failing(i, views):
        if i == 1:
            assert sched._loading, "a load in part when the update raises"
            raise RuntimeError("boom")
        _update(i, views)

    before = [t.clone() for ts in tensors for t in ts]
    with pytest.raises(RuntimeError, match="boom"):
        sched.run(transfers, failing)
    assert sched._loading == {}
    for t, b in zip((t for ts in tensors for t in ts), before, strict=True):
        t.copy_(b)  # the state as before the failed run
    sched.run(transfers, _update)
    for got, exp in zip(tensors, want, strict=True):
        for a, b in zip(got, exp, strict=True):
            assert torch.equal(a, b)
