"""Loads queued ahead of a step (``prefetch()``, engine/prefetch.py) through the CPU path, where
they copy at once: a step that takes them equals the step alone bitwise, and a step that must
not (another plan, state loaded or dropped since) drops them and still gives the right bits; the
backward hook prefetches once an iteration. On a GPU (``cuda``): a training loop with prefetch
and stores left running equals one without, and state_dict() right after step() is final."""

import copy
import gc

import pytest
import torch
from _mixed_runs import assert_bitwise

from muon_offload import AdamW, Muon
from muon_offload.engine import scheduler as scheduler_module

SHAPES = [(24, 40), (24, 40), (40, 24), (3, 8, 12), (16, 16), (77,), (300,), (5,), (1031,)]


def _init(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _opt(params, **kwargs):
    groups = [
        dict(params=params[:5]),
        dict(params=params[5:7], algorithm="adamw"),
        dict(params=params[7:], algorithm="lion"),
    ]
    return Muon(groups, lr=0.02, weight_decay=0.05, **kwargs)


def _grads(params, s, skip=()):
    gen = torch.Generator().manual_seed(300 + s)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen)
        p.grad = None if i in skip else g


def _loop(init, steps=4, between=None, skip=lambda s: (), **kwargs):
    """``steps`` steps; ``between(opt, s)`` runs after step s's gradients are set, before it."""
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = _opt(params, **kwargs)
    for s in range(steps):
        _grads(params, s, skip(s))
        if between is not None:
            between(opt, s)
        opt.step()
    return params, opt


class _Loads:
    """Counts the scheduler's loads (``StreamScheduler._load``), ahead of a run or in it."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = scheduler_module.StreamScheduler._load

        def spy(sched, k, chunk):
            self.count += 1
            return real(sched, k, chunk)

        monkeypatch.setattr(scheduler_module.StreamScheduler, "_load", spy)


@pytest.mark.parametrize("state_dtype", [None, torch.int8])
@pytest.mark.parametrize("chunk_bytes", [3000, 12000, 1 << 30])
def test_prefetch_then_step_equals_step_alone_bitwise(monkeypatch, state_dtype, chunk_bytes):
    """prefetch() before each step: the step loads only the chunks not loaded ahead, and the
    result equals the offloaded step without prefetch and the resident twin, bit for bit."""
    init = _init()
    kwargs = dict(state_dtype=state_dtype, backend="torch")
    resident = _loop(init, **kwargs)
    alone = _loop(init, offload=True, chunk_bytes=chunk_bytes, **kwargs)
    loads, issued = _Loads(monkeypatch), []

    def between(opt, s):
        loads.count = 0
        issued.append(opt.prefetch())
        n = loads.count
        assert (n >= 1) == issued[-1]
        assert opt.prefetch() is issued[-1] and loads.count == n  # queued once

    ahead = _loop(init, offload=True, chunk_bytes=chunk_bytes, between=between, **kwargs)
    assert issued == [False, True, True, True]  # nothing to prefetch before the first step
    # The last step's loads, ahead and in the run: each streamed chunk once.
    assert loads.count == len(ahead[1]._streams.scheduler._streamed)
    assert_bitwise(ahead, alone)
    assert_bitwise(ahead, resident)


def test_prefetch_loads_the_chunks_that_fit_before_the_arena_wraps():
    """As many chunks as the arena holds before it wraps: more than one with small chunks,
    all of them when the arena holds the whole step."""
    for chunk_bytes, some in ((3000, True), (1 << 30, False)):
        _, opt = _loop(_init(), steps=1, offload=True, chunk_bytes=chunk_bytes, backend="torch")
        sched = opt._streams.scheduler
        opt.prefetch()
        n, streamed = sched.ahead.loads, len(sched._streamed)
        assert n == sum(1 for a in sched.layout.issue_after if a < 0)
        assert (1 < n < streamed) if some else n == streamed, (n, streamed)


def test_a_plan_change_drops_the_prefetch():
    """Between prefetch() and step(): other parameters with gradients (another plan), new
    budgets (another scheduler), and back to the first plan (cached, prefetched for another):
    every step equals the twin that never prefetched, bit for bit."""
    init = _init(1)
    pattern = {1: (2, 6), 2: (0,), 4: (2, 6)}
    kwargs = dict(
        offload=True, chunk_bytes=3000, backend="torch", skip=lambda s: pattern.get(s, ())
    )

    def between(opt, s):
        opt.prefetch()
        if s == 3:
            opt.reconfigure(chunk_bytes=5000)

    twin = _loop(init, steps=6, **kwargs)
    ahead = _loop(init, steps=6, between=between, **kwargs)
    assert_bitwise(ahead, twin)


@pytest.mark.parametrize("state_dtype", [None, torch.int8])
@pytest.mark.parametrize("how", ["load_state_dict", "del", "new state", "assign"])
def test_state_written_or_dropped_after_a_prefetch_is_what_the_step_reads(how, state_dtype):
    """A prefetch, then host state written (load_state_dict of an earlier checkpoint) or state
    dropped (``del opt.state[p]``, a new ``opt.state``) or assigned (``opt.state[p] = {...}``):
    the step reads the new state, bit for bit as the twin that never prefetched."""
    init = _init(2)
    kwargs = dict(offload=True, chunk_bytes=3000, state_dtype=state_dtype, backend="torch")
    saved = {}

    def between(opt, s, prefetch=True):
        if s == 1:
            saved["sd"] = copy.deepcopy(opt.state_dict())
        if s != 3:
            return
        if prefetch:
            assert opt.prefetch()
        if how == "load_state_dict":
            opt.load_state_dict(saved["sd"])
        elif how == "del":
            params = opt.param_groups[0]["params"] + opt.param_groups[1]["params"]
            for p in params[::2]:
                del opt.state[p]
        elif how == "new state":
            opt.state = type(opt.state)(dict)
        else:  # other values, of the same shapes and dtypes
            for p in opt.param_groups[0]["params"][::2] + opt.param_groups[1]["params"]:
                opt.state[p] = {k: v.roll(1, 0) for k, v in opt.state[p].items()}

    twin = _loop(init, steps=5, between=lambda o, s: between(o, s, False), **kwargs)
    ahead = _loop(init, steps=5, between=between, **kwargs)
    assert_bitwise(ahead, twin)


def _model(seed=3, width=24):
    """``width=96``: a 96 x 96 matrix, 8-bit with ``state_dtype=torch.int8``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, width),
        torch.nn.Linear(width, 4),
    )


def _train(prefetch, steps=4, accumulate=1, spy=None, **kwargs):
    model = _model()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    opt = Muon(
        [dict(params=matrices), dict(params=others, algorithm="adamw")],
        lr=0.02,
        offload=True,
        chunk_bytes=2000,
        backend="torch",
        prefetch=prefetch,
        **kwargs,
    )
    if spy is not None:
        spy(opt)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        for _ in range(accumulate):
            x = torch.randn(8, 12, generator=gen)
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()  # torch's default: gradients set to None
    return list(model.parameters()), opt


@pytest.mark.parametrize("accumulate", [1, 2])
def test_backward_hook_prefetches_once_an_iteration(accumulate):
    """The first gradient accumulated after a step calls prefetch() (once, however many
    parameters and backward passes follow); it queues loads from the second iteration on, which
    that step takes; the parameters equal the run with prefetch=False bit for bit."""
    calls = []

    def spy(opt):
        real = opt.prefetch

        def counted():
            calls.append(real())
            return calls[-1]

        opt._prefetcher.prefetch = counted  # what the hooks call (opt.prefetch is it)

    ahead = _train(True, accumulate=accumulate, spy=spy)
    assert calls == [True, True, True]  # the first backward ran before any step
    off = _train(False, accumulate=accumulate)
    assert_bitwise(ahead, off)
    assert all(len(p._post_accumulate_grad_hooks or {}) == 0 for p in off[0])


def test_hooks_go_with_the_optimizer_and_stay_out_of_copies():
    """One hook a parameter; a deep copy and state_dict() carry none; when the optimizer is
    collected, its hooks are removed; a parameter group added later is hooked too."""
    params, opt = _train(True, steps=1)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in params)
    clone = copy.deepcopy(opt)
    clone.step()  # the copy runs, with no hooks of its own
    assert "_prefetch_hooks" not in vars(clone)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in params)
    extra = torch.nn.Parameter(torch.randn(9))
    opt.add_param_group(dict(params=[extra], algorithm="adamw"))
    assert len(extra._post_accumulate_grad_hooks) == 1
    opt.state_dict()
    del opt, clone
    gc.collect()
    assert all(len(p._post_accumulate_grad_hooks) == 0 for p in [*params, extra])


def test_prefetch_setting_is_checked():
    with pytest.raises(ValueError, match="prefetch must be True or False"):
        AdamW([torch.nn.Parameter(torch.randn(3))], offload=True, prefetch="yes")
    resident = AdamW([torch.nn.Parameter(torch.randn(3))], prefetch=True)  # no offload
    assert resident.prefetch() is False and "_prefetch_hooks" not in vars(resident)


def _gpu_loop(
    prefetch, steps=6, check_state_dict=False, offload=True, cuda_graph=False, width=24, **kwargs
):
    """``cuda_graph=False``: eager steps; True: captured at step 1, replayed from step 2 (as
    three graphs: engine/graph_ends.py)."""
    model = _model(width=width).cuda()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    kwargs.setdefault("chunk_bytes", 2000)
    opt = Muon(
        [dict(params=matrices), dict(params=others, algorithm="adamw")],
        lr=0.02,
        offload=offload,
        prefetch=prefetch,
        cuda_graph=cuda_graph,
        **kwargs,
    )
    gen = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(steps):
        x = torch.randn(64, 12, generator=gen, device="cuda")
        torch.cuda._sleep(1_000_000)  # a busy compute stream: loads queued ahead run beside it
        model(x).square().mean().backward()
        opt.step()
        if check_state_dict:
            got = copy.deepcopy(opt.state_dict())  # right after the step: waits for its stores
            torch.cuda.synchronize()
            want = opt.state_dict()
            for i, entry in want["state"].items():
                for key, value in entry.items():
                    assert torch.equal(got["state"][i][key], value), (i, key)
        opt.zero_grad()
    torch.cuda.synchronize()
    return list(model.parameters()), opt


@pytest.mark.cuda
@pytest.mark.parametrize("state_dtype", [None, torch.int8])
def test_gpu_loop_with_prefetch_equals_loop_without_bitwise(state_dtype):
    ahead = _gpu_loop(True, state_dtype=state_dtype)
    assert ahead[1]._streams.scheduler.ahead.runs == 6
    assert_bitwise(ahead, _gpu_loop(False, state_dtype=state_dtype))
    assert_bitwise(ahead, _gpu_loop(False, state_dtype=state_dtype, offload=False))


@pytest.mark.cuda
def test_gpu_state_dict_right_after_step_is_the_state_after_synchronize():
    _gpu_loop(True, check_state_dict=True)


@pytest.mark.cuda
@pytest.mark.parametrize("state_dtype", [None, torch.int8])
@pytest.mark.parametrize("chunk_bytes", [2000, 1 << 30])
def test_gpu_graph_loop_with_prefetch_equals_loop_without_bitwise(
    monkeypatch, state_dtype, chunk_bytes
):
    """Graphs with fresh gradients (torch's default zero_grad): the head graph replayed from
    the backward hook, the tail left running under the next forward (engine/graph_ends.py),
    equal to the eager loop without prefetch, to graphs without prefetch (the step replays the
    head itself) and to the resident loop, bit for bit."""
    from muon_offload.engine.graph_ends import SplitStep

    heads = []  # per head replay: whether the step replayed it (no prefetch before it)
    real = SplitStep._replay_head
    monkeypatch.setattr(SplitStep, "_replay_head", lambda g, at: heads.append(at) or real(g, at))
    kwargs = dict(state_dtype=state_dtype, chunk_bytes=chunk_bytes, width=96)
    ahead = _gpu_loop(True, cuda_graph=True, **kwargs)
    stats = ahead[1].graph_stats()
    assert (stats["captures"], stats["replays"], stats["off"]) == (1, 4, None), stats
    assert isinstance(ahead[1]._graphing.graphs.held, SplitStep)
    assert heads == [True, False, False, False, False]  # the capture's, then from backward
    assert (stats["heads_ahead"], stats["heads_at_step"]) == (4, 1)
    assert_bitwise(ahead, _gpu_loop(False, **kwargs))
    assert_bitwise(ahead, _gpu_loop(False, cuda_graph=True, **kwargs))
    assert_bitwise(ahead, _gpu_loop(False, offload=False, **kwargs))


@pytest.mark.cuda
def test_gpu_graph_state_dict_right_after_a_replay_is_final():
    """state_dict() right after a replayed step waits for its tail graph's stores."""
    from muon_offload.engine.graph_ends import SplitStep

    params, opt = _gpu_loop(True, check_state_dict=True, cuda_graph=True, width=96)
    assert opt.graph_stats()["replays"] == 4 and isinstance(opt._graphing.graphs.held, SplitStep)


def test_prefetched_loads_wait_for_the_last_stores_not_for_backward(monkeypatch):
    """The CUDA path on stand-in streams (test_scheduler's): loads queued ahead follow every
    store of the last run (the compute stream waited for none of them) but not what the
    compute stream queued since (backward); the next run queues no load of theirs again, and
    its updates follow them; two runs give the right values."""
    from test_scheduler import _before, _chunks, _Cuda, _expected, _update

    from muon_offload.engine import prefetch

    cuda = _Cuda(monkeypatch)
    slab, tensors, transfers = _chunks([5000, 700, 64, 1300, 5000, 900])
    want = _expected(_expected(tensors))
    sched = cuda.scheduler(ring=2)  # the fifth chunk wraps: it waits for the first's store
    side = (False, True, False, True, True, False)
    first = sched.timeline = []
    sched.run(transfers, _update, side)
    backward = cuda.compute._add()  # queued after the step: the stores still run beside it
    last_store = [end.node for c, s, _, end in first if s == "store"][-1]
    assert not _before(last_store, backward)
    second = sched.timeline = []
    n = prefetch.issue(sched, transfers, side)
    assert n == 4, n
    sched.run(transfers, _update, side)
    loads = [(c, a.node, b.node) for c, s, a, b in second if s == "load"]
    assert [c for c, _, _ in loads] == list(range(len(transfers)))  # each queued once
    updates = {c: a.node for c, s, a, _ in second if s == "update"}
    for c, start, end in loads[:n]:
        assert not _before(backward, start)
        assert all(_before(e.node, start) for _, s, _, e in first if s == "store")
        assert _before(end, updates[c])
    for got, exp in zip(tensors, want, strict=True):
        for a, b in zip(got, exp, strict=True):
            assert torch.equal(a, b)


def test_stores_are_left_running_only_while_no_graph_is_in_use(monkeypatch):
    """The optimizer on the stand-in streams: with cuda_graph=False a step leaves its stores
    running (the compute stream waits for its updates only) and prefetch() queues loads;
    while graphs are in use (a StepGraphs held, not given up) a step joins every store into the
    compute stream and prefetch() does nothing; the results equal the resident twin."""
    from _mixed_runs import mixed_run
    from test_scheduler import _before, _Cuda

    from muon_offload.engine.graphs import StepGraphs

    cuda = _Cuda(monkeypatch)
    init = _init(4)
    kwargs = dict(backend="torch", cuda_graph=False)
    sched = cuda.scheduler()
    params, opt = mixed_run(
        init, 5, 2, seed=40, steps=2, scheduler=sched, offload=True, chunk_bytes=3000, **kwargs
    )
    assert sched.ahead.open and opt.prefetch()
    opt._graphing.graphs = StepGraphs(torch.device("cpu"))  # in use: a replay may follow
    assert not opt.prefetch()
    _grads(params, 9)
    opt.step()
    after = cuda.compute._add()
    assert not sched.ahead.open
    assert _before(sched.d2h_stream.last, after)
    # Given up (cuda_graph=True too: its steps stay eager from then on): in use no more, so
    # prefetch() queues loads and the step leaves its stores running again.
    opt._graphing.graphs.off = "given up"
    opt.cuda_graph = True
    assert opt.prefetch()
    opt.cuda_graph = False  # True refuses a step on these CPU tensors; the loads stay queued
    _grads(params, 10)
    opt.step()
    assert sched.ahead.open
    twin = mixed_run(init, 5, 2, seed=40, steps=2, **kwargs)
    for s in (9, 10):
        _grads(twin[0], s)
        twin[1].step()
    assert_bitwise((params, opt), twin)
