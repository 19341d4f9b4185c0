"""A captured step that streams state as two graphs and a held tail (engine/graph_ends.py):
the head (the first loads, replayed by ``prefetch()`` under backward), the main graph, and
the tail's stores, held after each replay and queued in slices from the next backward. On the
CPU: the replays' values against the eager twin with the graph emulator
(tests/_graph_emulator.py), and the order of the replays on test_scheduler's stand-in
streams. On a GPU: test_prefetch.py's graph loops (``cuda``)."""

import pytest
import torch
from _graph_emulator import RecordingGraph
from test_graph_fresh_grads import BF16_GRADS, INT8_SHAPES, SHAPES, _backward, _muon
from test_scheduler import _before, _chunks, _Cuda, _Event, _expected, _update
from test_tail_pacer import _until

from muon_offload.engine import prefetch, tail_pacer
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
    head itself at steps 3 and 7), fp32 gradients from step 4 on (a key change: the two graphs
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
    assert len(made) == 4 and all(g.was_reset for g in made[:2])
    # Heads: at 1 (the capture's replay), 2, 3, and 4's prefetch (dropped at the step); at 5,
    # 6's prefetch, and 7 (the eager step 6 took the arena after it).
    assert [g.replays for g in made] == [4, 3, 3, 2]
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
    assert len(made) == (2 if asked else 1)
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
def test_replays_run_the_first_loads_and_the_last_stores_under_backward(monkeypatch, lanes):
    """The head replays on the h2d stream after the last tail and (when prefetched) not after
    backward; the main graph after the head and backward; the tail's stores are held after
    the replay, queued on the d2h stream in slices by a thread the next backward's first hook
    starts (tail_pacer.py) or all at once by the next head, after the main graph's records
    and before the head, waiting for neither the forward nor backward; the next run's loads,
    an eager one's, queue what is left and wait for it. The main graph's capture loads only
    the chunks after the head, stores only those outside the tail (the stores no load waits
    for), and waits for no load event of the head's chunks (none recorded in it)."""
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
    head, main = graphs
    n, ends = first_loads(sched.layout), tail_of(sched.layout)
    assert 1 <= n < len(transfers) and ends and max(ends) == len(transfers) - 1
    assert [c for c, stage, _, _ in marks if stage == "load"] == list(range(n, len(transfers)))
    stored = [c for c, stage, _, _ in marks if stage == "store"]
    assert stored == [c for c in range(len(transfers)) if c not in ends]
    for j, waits in enumerate(sched.layout.waits):
        assert not ends & set(waits), j
    # The main graph records an external event after each tail chunk's update and after its
    # last store (both lanes store on the d2h stream), which the tail's first slice waits for.
    assert sched.ahead.split is None  # the capture's, cleared
    last_stores = split._split.stored
    assert [e.node.stream for e in last_stores] == ["d2h"]
    assert len(split._split.updated) == len(ends)
    waited = last_stores + split._split.updated
    assert sorted(map(id, main.records)) == sorted(map(id, waited))
    for _, stage, _, end in marks:  # the tail's stores follow the main graph's: a copy
        if stage == "store":  # engine runs them beside those the step's loads wait for
            assert any(_before(end.node, e.node) for e in last_stores)
    assert not head.records + head.waited + main.waited
    sched.timeline = None
    last_main = last_forward = None
    tail_bytes = sum(host.numel() for host, _ in split._tail_runs)
    monkeypatch.setattr(tail_pacer, "PACE_SLICE_BYTES", tail_bytes // 3 + 1)  # three slices
    tail_ends = []  # where each held tail queued all of its stores ends
    original = prefetch.launch_tail

    def launch(sched):
        queued = original(sched)
        if queued:
            tail_ends.append(sched.ahead.stored.node)
        return queued

    monkeypatch.setattr(prefetch, "launch_tail", launch)
    for s in range(4):
        backward = cuda.compute._add()
        prefetched = s % 2 == 1
        if prefetched:
            if last_main is not None:  # the first hook starts the thread: its three slices
                assert not prefetch.pace_tail(sched) and sched.ahead.tail is not None
                _until(lambda: sched.ahead.pacer.done)
                t = sched.ahead.stored.node  # after the main graph's records, not backward
                assert all(_before(e.node, t) for e in waited)
                assert not _before(last_forward, t) and not _before(backward, t)
            assert split.prefetch() and split.prefetch()
        late = cuda.compute._add()  # the rest of backward
        queued = len(tail_ends)
        split.replay()
        forward = cuda.compute._add()
        assert len(head.replayed) == len(main.replayed) == s + 1
        held = sched.ahead.tail
        assert held is not None and not held.started  # held, nothing queued
        h, m = head.replayed[-1], main.replayed[-1]
        assert (h.stream, m.stream) == ("h2d", "compute")
        assert _before(h, m) and _before(late, m)
        if last_main is not None:  # the last step's tail: all of it queued before this head
            assert len(tail_ends) == queued + (0 if prefetched else 1)
            t = tail_ends[-1]
            assert t.stream == "d2h" and _before(last_main, t) and _before(t, h)
            assert not _before(last_forward, t) and not _before(backward, t)
        # Under backward once a replay left its tail; at the step (no prefetch, or after the
        # capture, which joined its stores) after what the compute stream queued.
        assert _before(late, h) == (not prefetched)
        assert _before(backward, h) == (not prefetched or last_main is None)
        last_main, last_forward = m, forward
    marks = sched.timeline = []
    sched.run(transfers, _update, side)  # an eager run after a replay (a key change)
    assert sched.ahead.tail is None and len(tail_ends) == 4  # the last one queued by the run
    assert _before(last_main, tail_ends[-1])
    for _, stage, start, _ in marks:
        if stage == "load":
            assert _before(tail_ends[-1], start.node)
    for got, exp in zip(tensors, want, strict=True):  # copies run at once on the stand-ins
        for a, b in zip(got, exp, strict=True):
            assert torch.equal(a, b)


def test_a_held_tail_stores_every_byte_once_in_order_a_budget_a_slice():
    """``HeldTail.issue``: slices of at most the budget, cut inside runs and across them,
    store the bytes of the runs in run order, each once; None stores the rest."""
    gen = torch.Generator().manual_seed(3)
    sizes = (5, 3000, 17, 1, 64)
    staged = [torch.randint(1, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    host = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    tail = prefetch.HeldTail(list(zip(host, staged, strict=True)), [])
    sched = type("Sched", (), {"cuda": False})()
    stored = 0
    for budget, at in ((1, (0, 1)), (4, (1, 0)), (1000, (1, 1000)), (1999, (1, 2999))):
        assert not tail.issue(sched, budget)
        stored += budget
        assert (tail.run, tail.offset) == at
        flat = torch.cat(host)
        assert int((flat != 0).sum()) == stored and bool((flat[:stored] != 0).all())
    assert not tail.issue(sched, 3) and (tail.run, tail.offset) == (2, 2)
    assert tail.issue(sched, None)
    for h, s in zip(host, staged, strict=True):
        assert torch.equal(h, s)


def _differs(opt, params, twin, twin_params) -> bool:
    """Whether any host state reads other bits than the twin's (without writing anything
    back: the dict the step reads)."""
    return any(
        not torch.equal(opt._state[p][k], twin._state[q][k])
        for p, q in zip(params, twin_params, strict=True)
        for k in opt._state[p]
    )


@pytest.mark.parametrize("reader", ["state", "in_place", "state_dict", "key_change"])
def test_a_held_tail_is_written_back_before_anything_reads_host_state(monkeypatch, reader):
    """A replayed split step holds its tail's stores (launched by the next head, under the
    next backward): until then the host bytes of its last chunks are the last step's. Each
    reader launches it first: ``opt.state`` (so a write in place into a state tensor is not
    overwritten later), ``state_dict()``, and a key change that drops the graphs with no
    prefetch before it (gradients set by hand: no hook fires)."""
    made: list[RecordingGraph] = []
    pair = _pair(monkeypatch, made, SHAPES, chunk_bytes=3000)
    (opt, params), (twin, twin_params) = pair

    def step(s, dtype=torch.float32, prefetched=True):
        for o, ps in pair:
            gen = torch.Generator().manual_seed(100 + s)
            for p in ps:
                if hasattr(p, "grad_dtype"):  # torch >= 2.12 asks first
                    p.grad_dtype = None
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            if prefetched:
                o.prefetch()
            o.step()
            o.zero_grad()

    for s in range(3):  # eager, capture, replay
        step(s)
    assert opt.graph_stats()["replays"] == 1 and made[1].replays == 2  # and the capture's
    assert _differs(opt, params, twin, twin_params)  # the replay's tail is held
    if reader == "state":
        _assert_twins(params, opt, twin_params, twin, "read")
    elif reader == "in_place":
        for o, ps in pair:
            o.state[ps[0]]["momentum"].mul_(0.5)
        step(3)
        _assert_twins(params, opt, twin_params, twin, "in place")
    elif reader == "state_dict":
        saved, saved_twin = opt.state_dict()["state"], twin.state_dict()["state"]
        for i, values in saved.items():
            for k, v in values.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(saved_twin[i][k])), k
    else:
        step(3, torch.bfloat16, prefetched=False)  # the graphs dropped: the step is eager
        assert opt.graph_stats()["captures"] == 1 and made[1].was_reset
        assert not _differs(opt, params, twin, twin_params)
    assert not _differs(opt, params, twin, twin_params)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_miss_in_either_capture_gives_graphs_up(monkeypatch, failing):
    """The head or main capture raises (a tuning decision missing under capture): the
    graphs captured before it are reset, graphs are given up, and the steps run eagerly, bit
    for bit as the twin."""
    from muon_offload.kernels._launch import CaptureMiss

    made: list[RecordingGraph] = []
    pair = _pair(monkeypatch, made, SHAPES, chunk_bytes=3000)
    (opt, params), (twin, twin_params) = pair
    real = RecordingGraph.capture

    def capture(graph, body):
        if graph is made[failing]:  # head or main of the first capture
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
    assert stats["replays"] == 0 and len(made) == 2
    assert all(g.was_reset for g in made)


def test_a_new_staging_budget_keeps_the_backward_hooks_prefetching(monkeypatch):
    """``prefetch_bytes`` changed after the first step: the next step runs on a new scheduler
    (a new arena), whose run count starts afresh. The backward hooks still prefetch once a
    run of it, so the step captured after is split and its head runs ahead from then on (the
    hooks once compared the new scheduler's count with the old one's, skipped the prefetch
    before the capture, and the step was captured whole for good). Bitwise the eager twin."""
    made: list[RecordingGraph] = []
    pair = _pair(monkeypatch, made, SHAPES, chunk_bytes=3000)
    (opt, params), (twin, twin_params) = pair
    for s in range(6):
        for o, ps in pair:
            _backward(ps, s, BF16_GRADS)
            o.step()
            o.zero_grad()
            if s == 0:
                o.prefetch_bytes = 9000
        _assert_twins(params, opt, twin_params, twin, s)
    stats = opt.graph_stats()
    assert isinstance(opt._graphing.graphs.held, SplitStep), stats
    assert stats["captures"] == 1 and stats["heads_ahead"] >= 2, stats


def test_a_new_scheduler_keeps_whether_the_loop_prefetches(monkeypatch):
    """New budgets make a new scheduler for the next step, after that step's backward hooks
    asked the old one for loads ahead. Where the step is captured at once (its graph key
    settled: the new arena may take the old one's addresses), it is split as the old
    scheduler's would have been, not captured whole for good."""
    made: list[RecordingGraph] = []
    (opt, params), _ = _pair(monkeypatch, made, SHAPES, chunk_bytes=3000)
    _backward(params, 0, BF16_GRADS)
    opt.step()
    opt.zero_grad()
    _backward(params, 1, BF16_GRADS)  # the hooks prefetch for the old scheduler
    old = opt._streams.scheduler
    assert old.ahead.asked
    opt.prefetch_bytes = 9000
    new = opt._streams.for_step(torch.device("cpu"))
    assert new is not old and new.ahead.asked
