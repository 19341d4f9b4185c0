"""A captured step that streams state as three graphs (engine/graph_ends.py): the head (the
first loads, replayed by ``prefetch()`` under backward), the main graph and the tail (the last
stores, left running under the next forward). On the CPU: the replays' values against the eager
twin with the graph emulator (tests/_graph_emulator.py), and the order of the replays on
test_scheduler's stand-in streams. On a GPU: test_prefetch.py's graph loops (``cuda``)."""

import pytest
import torch
from _graph_emulator import RecordingGraph
from test_graph_fresh_grads import BF16_GRADS, INT8_SHAPES, SHAPES, _backward, _muon
from test_scheduler import _before, _chunks, _Cuda, _Event, _expected, _update

from muon_offload.engine.graph_ends import SplitStep, tail_of
from muon_offload.engine.prefetch import first_loads


def _pair(monkeypatch, made, shapes, **kw):
    pair = []
    for graphed in (True, False):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        pair.append((_muon(params, monkeypatch, made, graphed, offload=True, **kw), params))
    return pair


def _assert_twins(params, opt, twin_params, twin, step) -> None:
    """After ``step``: the same weights and state as the eager twin, bit for bit."""
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q), step
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], twin.state[q][key]), (step, key)


@pytest.mark.parametrize(
    ("shapes", "kw"),
    [
        (SHAPES, {"chunk_bytes": 3000}),
        (SHAPES, {"chunk_bytes": 1 << 30}),  # the arena holds the step: all head, all tail
        (INT8_SHAPES, {"chunk_bytes": 6000, "state_dtype": torch.int8}),
    ],
)
def test_split_replays_with_prefetch_equal_the_eager_step_bitwise(monkeypatch, shapes, kw):
    """Eight steps of fresh gradients, prefetch() before most of them (the step replays the
    head itself at steps 3 and 7), fp32 gradients from step 4 on (a key change: the three graphs
    dropped, eager, captured again), step 6 eager under ``timeline()`` after its prefetch (the
    graph held: its arena rewritten, so step 7 replays the head again): every step equals the
    eager offloaded twin, bit for bit; prefetch() replays the head of a held graph once, and
    nothing while none is held."""
    made: list[RecordingGraph] = []
    pair = _pair(monkeypatch, made, shapes, **kw)
    (opt, params), (twin, twin_params) = pair
    prefetched = []
    for s in range(8):
        for o, ps in pair:
            _backward(ps, s, BF16_GRADS if s < 4 else {})
            if o is opt and s not in (3, 7):
                prefetched.append(o.prefetch())
                heads = made[0].replays if made else 0
                assert o.prefetch() is prefetched[-1]
                assert (made[0].replays if made else 0) == heads  # once a step
            o.param_groups[0]["lr"] *= 0.9
            if s == 6:
                with o.timeline():
                    o.step()
            else:
                o.step()
            o.zero_grad()
        _assert_twins(params, opt, twin_params, twin, s)
    # 0 eager; 1 capture; 2, 3 replay; 4 dropped, eager; 5 capture; 6 eager (timed); 7 replay.
    assert prefetched == [False, False, True, True, False, True]
    stats = opt.graph_stats()
    assert (stats["captures"], stats["replays"], stats["off"]) == (2, 3, None)
    assert len(made) == 6 and all(g.was_reset for g in made[:3])
    # Heads: at 1 (the capture's replay), 2, 3, and 4's prefetch (dropped at the step); at 5,
    # 6's prefetch, and 7 (the eager step 6 took the arena after it).
    assert [g.replays for g in made] == [4, 3, 3, 3, 2, 2]
    assert isinstance(opt._graphing.graphs.held, SplitStep)
    # graph_stats() counts the held graph's: its capture's replay at 5 loads the head itself;
    # at 6 and 7 it ran ahead (6's prefetch(); 7's backward hook, the arena taken at 6).
    assert (stats["heads_ahead"], stats["heads_at_step"]) == (2, 1)


@pytest.mark.parametrize("asked", [False, True], ids=["no-prefetch", "prefetch"])
def test_a_step_nobody_prefetches_is_captured_whole(monkeypatch, asked):
    """Gradients set by hand, no backward (the hooks never fire) and no prefetch(): nothing
    runs beside the step's first loads and last stores, and one graph keeps the pipeline's
    overlap at both ends (its first update waits for one load, not for all of a head's; its
    last stores overlap the last updates), so the step is captured whole. With prefetch()
    before each step it is split. Either way bitwise the eager twin's."""
    made: list[RecordingGraph] = []
    pair = _pair(monkeypatch, made, SHAPES, chunk_bytes=3000)
    (opt, params), (twin, twin_params) = pair
    for s in range(4):
        for o, ps in pair:
            gen = torch.Generator().manual_seed(100 + s)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            if asked:
                o.prefetch()
            o.step()
            o.zero_grad()
        _assert_twins(params, opt, twin_params, twin, s)
    stats = opt.graph_stats()
    assert (stats["captures"], stats["replays"], stats["off"]) == (1, 2, None)
    assert isinstance(opt._graphing.graphs.held, SplitStep) == asked
    assert len(made) == (3 if asked else 1)
    # The capture's replay loads its head itself; the replays after it find it loaded ahead.
    assert (stats["heads_ahead"], stats["heads_at_step"]) == ((2, 1) if asked else (0, 0))


class _StandInGraph:
    """A graph on test_scheduler's stand-in streams: ``capture`` runs the body as a capture
    (each wait names an event recorded in it, or an external one: a wait node);
    ``replay`` queues one node on the current stream, the whole graph (a replay completes as a
    whole on the stream it is launched on), after the last records of the external events it
    waits for, and records the external events recorded in its capture."""

    def __init__(self, cuda, sched):
        self.cuda, self.sched, self.replayed = cuda, sched, []
        self.records, self.waited = [], []

    def capture(self, body):
        streams = self.cuda.streams(self.sched)
        for s in streams:
            s.waits = []
        start, self.cuda.capturing = len(self.cuda.log), True
        recorded = len(_Event.recorded)
        try:
            body()
        finally:
            self.cuda.capturing = False
        self.records = _Event.recorded[recorded:]
        for s in streams:
            inner = [w for w in s.waits if not w.event.external]
            assert all(w.deps[-1].index >= start for w in inner), s.name
            self.waited += [w.event for w in s.waits if w.event.external]

    def replay(self):
        node = self.cuda.current._add()
        node.deps += [event.node for event in self.waited]
        for event in self.records:
            event.node = node
        self.replayed.append(node)

    def reset(self):
        pass


@pytest.mark.parametrize("lanes", [2, 1])
def test_replays_run_the_first_loads_under_backward_and_the_last_stores_under_forward(
    monkeypatch, lanes
):
    """The head replays on the h2d stream after the last tail and (when prefetched) not after
    backward; the main graph after the head and backward; the tail on the d2h stream after the
    main graph, and the next forward does not wait for it; the next run's loads, an eager
    one's, wait for it. The main graph's capture loads only the chunks after the head, stores
    only those outside the tail (the stores no load waits for), and waits for no load event of
    the head's chunks (none recorded in it); the tail's stores wait for its stores."""
    cuda = _Cuda(monkeypatch)
    slab, tensors, transfers = _chunks([5000, 700, 64, 1300, 5000, 900, 2000])
    want = _expected(_expected(tensors))  # the capture's copies, then an eager run's
    side = (False, True, False, True, True, False, True) if lanes == 2 else None
    sched = cuda.scheduler(ring=2)
    graphs = []

    def new_graph():
        graphs.append(_StandInGraph(cuda, sched))
        return graphs[-1]

    split = SplitStep(new_graph, sched, transfers, side)
    marks = sched.timeline = []
    split.capture(lambda: sched.run(transfers, _update, side))
    head, main, tail = graphs
    n, ends = first_loads(sched.layout), tail_of(sched.layout)
    assert 1 <= n < len(transfers) and ends and max(ends) == len(transfers) - 1
    assert [c for c, stage, _, _ in marks if stage == "load"] == list(range(n, len(transfers)))
    stored = [c for c, stage, _, _ in marks if stage == "store"]
    assert stored == [c for c in range(len(transfers)) if c not in ends]
    for j, waits in enumerate(sched.layout.waits):
        assert not ends & set(waits), j
    # Each of the tail's stores waits for its chunk's update through an external event that
    # the main graph records, and first for one it records after the last store of each store
    # stream (the main graph waits for none, records no other).
    assert sched.ahead.split is None  # the capture's, cleared
    stored = split._split.stored
    assert [e.node.stream for e in stored] == ["d2h", "side_d2h"][:lanes]
    assert tail.waited == stored + split._split.updated
    assert len(tail.waited) == len(ends) + lanes
    assert sorted(map(id, main.records)) == sorted(map(id, tail.waited))
    for _, stage, _, end in marks:  # the tail's stores follow the main graph's: a copy
        if stage == "store":  # engine runs them beside those the step's loads wait for
            assert any(_before(end.node, e.node) for e in stored)
    assert not head.records + head.waited + main.waited + tail.records
    sched.timeline = None
    last_tail = None
    for s in range(4):
        backward = cuda.compute._add()
        prefetched = s % 2 == 1
        if prefetched:
            assert split.prefetch() and split.prefetch()
        late = cuda.compute._add()  # the rest of backward
        split.replay()
        forward = cuda.compute._add()
        assert len(head.replayed) == len(main.replayed) == len(tail.replayed) == s + 1
        h, m, t = head.replayed[-1], main.replayed[-1], tail.replayed[-1]
        assert (h.stream, m.stream, t.stream) == ("h2d", "compute", "d2h")
        assert _before(h, m) and _before(late, m) and _before(m, t)
        assert not _before(t, forward)
        assert _before(t, sched.ahead.stores[sched.d2h_stream].node)
        if last_tail is not None:
            assert _before(last_tail, h)
        # Under backward once a replay left its tail running; at the step (no prefetch, or
        # after the capture, which joined its stores) after what the compute stream queued.
        assert _before(late, h) == (not prefetched)
        assert _before(backward, h) == (not prefetched or last_tail is None)
        last_tail = t
    marks = sched.timeline = []
    sched.run(transfers, _update, side)  # an eager run after a replay (a key change)
    for _, stage, start, _ in marks:
        if stage == "load":
            assert _before(last_tail, start.node)
    for got, exp in zip(tensors, want, strict=True):  # copies run at once on the stand-ins
        for a, b in zip(got, exp, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_miss_in_any_of_the_three_captures_gives_graphs_up(monkeypatch, failing):
    """The head, main or tail capture raises (a tuning decision missing under capture): the
    graphs captured before it are reset, graphs are given up, and the steps run eagerly, bit
    for bit as the twin."""
    from muon_offload.kernels._launch import CaptureMiss

    made: list[RecordingGraph] = []
    pair = _pair(monkeypatch, made, SHAPES, chunk_bytes=3000)
    (opt, params), (twin, twin_params) = pair
    real = RecordingGraph.capture

    def capture(graph, body):
        if graph is made[failing]:  # head, main or tail of the first capture
            raise CaptureMiss("muon_apply was not tuned before the capture")
        real(graph, body)

    monkeypatch.setattr(RecordingGraph, "capture", capture)
    for s in range(4):
        for o, ps in pair:
            _backward(ps, s, BF16_GRADS)
            o.step()
            o.zero_grad()
        _assert_twins(params, opt, twin_params, twin, s)
    stats = opt.graph_stats()
    assert "the capture failed: CaptureMiss" in stats["off"], stats
    assert stats["replays"] == 0 and len(made) == 3
    assert all(g.was_reset for g in made)
