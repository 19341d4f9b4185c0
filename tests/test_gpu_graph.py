"""``cuda_graph=True`` (and the default "auto") on a GPU: replayed steps equal eager steps bit
for bit (Muon with fp32, bf16 and 8-bit state, AdamW; resident and offloaded), hyper-parameter
changes reach the replay, gradients that backward allocates afresh every step (torch's default
``zero_grad()``) replay too, ``load_state_dict`` re-captures. Each test runs the same steps on
an optimizer without graphs and compares weights and state exactly.

Run: ``python -m pytest -q -m cuda tests/test_gpu_graph.py -s`` (-s shows the graph pools'
sizes)."""

import copy

import pytest
import torch

from muon_offload import AdamW, Muon

pytestmark = pytest.mark.cuda


def _model(seed=0):
    """Matrices of two shapes and long vectors: with 1 MiB chunks, offloaded steps run
    several chunks and the staging arena wraps inside a step."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(128, 512)] * 8 + [(512, 128)] * 4 + [(1 << 20,)] * 2 + [(3001,)]
    return [torch.randn(s, generator=gen) for s in shapes]


def _make(kind, init, graph, **kw):
    params = [torch.nn.Parameter(t.cuda()) for t in init]
    if kind == "adamw":
        opt = AdamW(params, lr=1e-3, weight_decay=0.1, cuda_graph=graph, **kw)
    else:
        groups = [
            dict(params=params[:12]),
            dict(params=params[12:14], algorithm="adamw", lr=3e-3),
            dict(params=params[14:], algorithm="lion", lr=1e-4),
        ]
        opt = Muon(groups, lr=0.02, cuda_graph=graph, **kw)
    return params, opt


def _grads(params, step, move=False):
    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    for p in params:
        g = torch.randn(p.shape, device="cuda", generator=gen)
        if p.grad is None or move:
            p.grad = g
        else:
            p.grad.copy_(g)  # in place: the graph's gradients stay where they are


def _schedule(opt, step):
    """An LR schedule every step; weight decay, betas and mu changed after the capture."""
    if step == 0:
        opt.base_lrs = [g["lr"] for g in opt.param_groups]
    for g, base in zip(opt.param_groups, opt.base_lrs, strict=True):
        g["lr"] = base * (1.0 - 0.1 * step)
        if step == 4:
            g["weight_decay"] = 0.2
            if "mu" in g:
                g["mu"] = 0.9
            if "beta1" in g:
                g["beta1"] = 0.8
            if "betas" in g:
                g["betas"] = (0.8, 0.99)


def _run_pair(kind, steps=7, between=None, move_at=(), graph=True, **kw):
    init = _model()
    pair = [_make(kind, init, mode, **kw) for mode in (graph, False)]
    kept = []
    for s in range(steps):
        for params, opt in pair:
            _grads(params, s, move=s in move_at)
            kept.append([p.grad for p in params])  # moved gradients: new addresses
            _schedule(opt, s)
            if between is not None:
                between(opt, s)
            opt.step()
    torch.cuda.synchronize()
    (graphed, g_opt), (eager, e_opt) = pair
    for p, q in zip(graphed, eager, strict=True):
        assert torch.equal(p, q)
        for k in g_opt.state[p]:
            assert torch.equal(g_opt.state[p][k], e_opt.state[q][k]), k
    stats = g_opt.graph_stats()
    print(f"\n{kind} {kw}: {stats} pool {stats['pool_bytes'] / 2**20:.1f} MiB")
    assert stats["off"] is None
    return stats


CASES = [
    ("muon", {}),
    ("muon", {"state_dtype": torch.bfloat16}),
    ("muon", {"state_dtype": torch.int8}),
    ("adamw", {}),
    ("muon", {"offload": True, "chunk_bytes": 1 << 20}),
    ("muon", {"offload": True, "chunk_bytes": 1 << 20, "state_dtype": torch.int8}),
    ("adamw", {"offload": True, "chunk_bytes": 1 << 20}),
    ("muon", {"offload": True, "chunk_bytes": 1 << 20, "resident_bytes": 1 << 20}),
]


@pytest.mark.parametrize(("kind", "kw"), CASES)
def test_replay_equals_eager_bitwise(kind, kw):
    stats = _run_pair(kind, **kw)
    assert stats["captures"] == 1 and stats["replays"] == 5  # 0 eager, 1 capture, 2-6 replay


@pytest.mark.parametrize("kw", [{}, {"offload": True, "chunk_bytes": 1 << 20}])
def test_auto_default_replays_as_true_does(kw):
    stats = _run_pair("muon", graph="auto", **kw)
    assert stats["captures"] == 1 and stats["replays"] == 5


def test_moved_gradients_keep_replaying_exactly():
    stats = _run_pair("muon", steps=8, move_at=(4,), offload=True, chunk_bytes=1 << 20)
    # 0 eager, 1 capture, 2-7 replay: the kernels read gradients through the gradient table
    assert stats["captures"] == 1 and stats["replays"] == 6


@pytest.mark.parametrize(("kind", "kw"), CASES)
def test_default_zero_grad_loop_replays_bitwise(kind, kw):
    """The loop users write: backward, step, ``zero_grad()`` at torch's default
    (set_to_none=True), so every step's gradients are new tensors. "auto" replays after its
    warm-up, bit for bit the eager optimizer's (cuda_graph=False)."""
    init = _model()
    pair = [_make(kind, init, mode, **kw) for mode in ("auto", False)]
    for s in range(6):
        for params, opt in pair:
            gen = torch.Generator(device="cuda").manual_seed(2000 + s)
            xs = [torch.randn(p.shape, device="cuda", generator=gen) for p in params]
            sum((p * x).sum() for p, x in zip(params, xs, strict=True)).backward()
            _schedule(opt, s)
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    (graphed, g_opt), (eager, e_opt) = pair
    for p, q in zip(graphed, eager, strict=True):
        assert torch.equal(p, q)
        for k in g_opt.state[p]:
            assert torch.equal(g_opt.state[p][k], e_opt.state[q][k]), k
    stats = g_opt.graph_stats()
    print(f"\n{kind} {kw}: {stats}")
    # 0 eager, 1 capture, 2-5 replay
    assert stats["off"] is None and stats["captures"] == 1 and stats["replays"] == 4


def test_load_state_dict_drops_the_graph():
    saved = {}

    def between(opt, step):
        if step == 3:
            if not saved:  # the first of the pair (graphed) saves; both load the same copy
                saved["sd"] = copy.deepcopy(opt.state_dict())
            opt.load_state_dict(saved["sd"])

    stats = _run_pair("muon", between=between, offload=True, chunk_bytes=1 << 20)
    assert stats["captures"] == 2


def test_nesterov_change_recaptures():
    def between(opt, step):
        if step == 3:
            opt.param_groups[0]["nesterov"] = True

    stats = _run_pair("muon", between=between)
    assert stats["captures"] == 2


def test_replay_issues_in_a_fraction_of_the_eager_host_time():
    import time

    init = _model()
    times = {}
    for graph in (False, True):
        params, opt = _make("muon", init, graph)
        for s in range(8):
            _grads(params, s)
            torch.cuda.synchronize()
            start = time.perf_counter()
            opt.step()
            issued = time.perf_counter() - start
            torch.cuda.synchronize()
        times[graph] = issued
    print(
        f"\nhost time to issue a step: eager {times[False] * 1e3:.2f} ms, "
        f"replay {times[True] * 1e3:.2f} ms"
    )
    assert times[True] < times[False]


def test_invalidated_capture_leaves_the_rng_usable():
    """A capture invalidated by an operation capture forbids (a device-wide synchronize) fails,
    and the default CUDA generator, which the capture registered, still draws afterwards (torch
    2.11 leaves it in capture mode: graphs.release_rng)."""
    from muon_offload.engine import graphs

    graph = graphs._CudaGraph(torch.cuda.Stream())

    def body():
        torch.ones(8, device="cuda").add_(1)
        torch.cuda.synchronize()  # forbidden under capture: the capture is invalidated

    with pytest.raises(Exception):  # noqa: B017 (torch raises a RuntimeError subclass)
        graph.capture(body)
    torch.rand(4, device="cuda")
    torch.randn(4, device="cuda").sum().item()


@pytest.mark.parametrize("kind", ["adamw", "muon"])
@pytest.mark.parametrize("kw", [{}, {"offload": True, "chunk_bytes": 1 << 20}])
def test_replays_follow_each_parameters_step_count(kind, kw):
    """An AdamW vector frozen (gradient None) at steps 2 and 3: it has a step count of its own
    from then on, and the replays after read it from the scalar table (bitwise as eager;
    AdamW as torch's, a few fp32 roundings apart)."""
    init = _model()
    frozen = len(init) - 1 if kind == "adamw" else 13  # Muon: the adamw group's second
    pair = [_make(kind, init, mode, **kw) for mode in (True, False)]
    ref = [torch.nn.Parameter(t.cuda()) for t in init]
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1, foreach=False)
    runs = [*pair, (ref, ref_opt)] if kind == "adamw" else pair
    for s in range(10):
        for params, opt in runs:
            _grads(params, s)
            if s in (2, 3):
                params[frozen].grad = None
            opt.step()
    torch.cuda.synchronize()
    (graphed, g_opt), (eager, e_opt) = pair
    for p, q in zip(graphed, eager, strict=True):
        assert torch.equal(p, q)
        for k in g_opt.state[p]:
            assert torch.equal(g_opt.state[p][k], e_opt.state[q][k]), k
    assert g_opt.graph_stats()["replays"] >= 3
    assert int(g_opt.state_dict()["state"][frozen][g_opt.step_count_key]) == 8
    if kind == "adamw":
        for p, q in zip(graphed, ref, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
