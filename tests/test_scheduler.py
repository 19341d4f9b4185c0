"""The staging arena (engine/scheduler.py) without a GPU: where chunks are placed and what each
load waits for (``place``), the scheduler's stream code run on stand-in streams and events (every
pair of chunks that share arena bytes ordered, waits naming only events of their own step), and
steps with chunks of mixed sizes bitwise equal to resident ones."""

import contextlib
import random

import pytest
import torch

from muon_offload import Muon
from muon_offload.engine.host_slabs import ALIGN_BYTES, align_up
from muon_offload.engine.scheduler import ARENA_ALIGN, StreamScheduler, place, plan_transfer

MIB = 1 << 20


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _check_layout(sizes, arena):
    layout = place(sizes, arena)
    ranges = [(o, o + n) for o, n in zip(layout.offsets, sizes, strict=True)]
    before: list[set[int]] = []  # chunks whose stores each chunk's load follows
    for k, (start, end) in enumerate(ranges):
        assert start % ARENA_ALIGN == 0 and start >= 0 and end <= arena, (k, start, end)
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
    def __init__(self, log, deps):
        self.index = len(log)
        self.deps = deps
        log.append(self)


class _Stream:
    """Queued work as nodes: each follows the stream's previous node and what it waited for."""

    def __init__(self, log):
        self.log, self.last, self.waits = log, None, []

    def _add(self, extra=None):
        deps = [d for d in (self.last, extra) if d is not None]
        self.last = _Node(self.log, deps)
        return self.last

    def wait_event(self, event):
        assert event.node is not None, "a wait on an event never recorded"
        self.waits.append(self._add(event.node))

    def wait_stream(self, other):
        self._add(other.last)


class _Event:
    def __init__(self, enable_timing=False):
        self.node = None

    def record(self, stream):
        self.node = stream._add()


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


@pytest.mark.parametrize("ring", [2, 3])
def test_stream_code_orders_every_chunk_that_shares_bytes(monkeypatch, ring):
    """The CUDA path on stand-in streams and events (copies run at once on the CPU): the
    dependency graph it queues orders, within a step, each load after its own chunk's earlier
    sharers' stores, each update after its load and each store after its update, and, across
    steps, every load after the last step's stores; a step's waits name only events recorded in
    it (what a CUDA graph capture needs). Ring 2: neighbours share bytes, so a load is queued
    only after the store it waits for."""
    log: list[_Node] = []
    compute = _Stream(log)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    sizes = [5000, 700, 64, 1300, 5000, 900, 2000, 3333, 100, 5000, 64]
    slab, tensors, transfers = _chunks(sizes)
    want = _expected(_expected(tensors))
    transfers = [None] + transfers  # a resident chunk first
    sched = StreamScheduler(torch.device("cpu"), ring=ring)
    sched.cuda = True
    sched.h2d_stream, sched.d2h_stream = _Stream(log), _Stream(log)
    steps = []
    for _ in range(2):
        start, marks = len(log), []
        for s in (compute, sched.h2d_stream, sched.d2h_stream):
            s.waits = []
        sched.timeline = marks
        sched.run(transfers, lambda i, views: None if views is None else _update(i - 1, views))
        for s in (compute, sched.h2d_stream, sched.d2h_stream):
            assert all(w.deps[-1].index >= start for w in s.waits)  # events of this step only
        steps.append({(c, stage): (a.node, b.node) for c, stage, a, b in marks})
    layout = sched.layout
    ranges = [(o, o + n) for o, n in zip(layout.offsets, sched._sizes, strict=True)]
    for step in steps:
        for k in range(len(sizes)):
            c = k + 1
            assert _before(step[c, "load"][1], step[c, "update"][0])
            assert _before(step[c, "update"][1], step[c, "store"][0])
            for j in range(k):
                if _overlap(ranges[j], ranges[k]):
                    assert _before(step[j + 1, "store"][1], step[c, "load"][0]), (j, k)
    first, second = steps
    for c in range(1, len(sizes) + 1):
        for d in range(1, len(sizes) + 1):
            assert _before(first[c, "store"][1], second[d, "load"][0])
    # The copies ran at once, in the order queued: a valid order too, so the data is right.
    for got, exp in zip(tensors, want, strict=True):
        for a, b in zip(got, exp, strict=True):
            assert torch.equal(a, b)


MIXED = [(48, 80)] * 5 + [(80, 48)] * 2 + [(1031,), (257, 13), (300,), (129,), (4099,)]


def test_mixed_chunk_sizes_in_flight_equal_resident_bitwise():
    """Muon matrices larger than chunk_bytes (chunks of their own) between small element-wise
    chunks: several chunks share the arena at once, and four steps equal the resident step
    bitwise."""
    gen = torch.Generator().manual_seed(11)
    init = [torch.randn(s, generator=gen) for s in MIXED]

    def run(**kwargs):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        groups = [
            dict(params=params[:7]),
            dict(params=params[7:10], algorithm="adamw"),
            dict(params=params[10:], algorithm="lion"),
        ]
        opt = Muon(groups, lr=0.02, weight_decay=0.05, **kwargs)
        for s in range(4):
            g = torch.Generator().manual_seed(900 + s)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return params, opt

    off_params, off = run(offload=True, chunk_bytes=4000)
    res_params, res = run()
    layout = off._scheduler.layout
    sizes = off._scheduler._sizes
    assert len(set(sizes)) > 2, sizes
    # More chunks lie in the arena at once than a ring of three slots held.
    assert any(after < k - 3 for k, after in enumerate(layout.issue_after)), layout
    for a, b in zip(off_params, res_params, strict=True):
        assert torch.equal(a, b)
        for key in off.state[a]:
            assert torch.equal(off.state[a][key], res.state[b][key])
