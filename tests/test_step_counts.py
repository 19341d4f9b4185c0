"""AdamW's bias correction counts each parameter's own steps, as ``torch.optim.AdamW`` does and
dion's Muon (its per-parameter ``step_dev``, microsoft/dion at 0a059a4) does for AdamW groups:
a parameter frozen for some steps, one whose first gradient comes late and one whose state is
reset with ``del opt.state[p]`` each start from their own count, resident and offloaded,
chunked or not, on the Triton kernels (under the interpreter here) and the torch references;
checkpoints save and load the counts in torch's and dion's layouts."""

import copy
import io

import pytest
import torch

from muon_offload import AdamW, Muon

# As tests/test_vs_torch_adamw.py: the same formula, a few fp32 roundings apart. A wrong count
# is far outside it: the first step of a parameter that joins at step 5 moves 10 x lr with its
# own count and 2.4 x lr with the group's.
RTOL, ATOL = 1e-5, 1e-6

SHAPES = [(37, 19), (1031,), (300,), (3, 5, 7), (130,)]
STEPS = 7
FROZEN, LATE, RESET = 1, 2, 3  # indices into SHAPES


def _has_grad(i: int, step: int) -> bool:
    if i == FROZEN:  # no gradient for two steps (torch's test_optim.py skips steps likewise)
        return step not in (2, 3)
    if i == LATE:  # unfrozen at step 4
        return step >= 4
    return True


def _init(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _run(make, init, steps=range(STEPS), params=None, opt=None):
    """Steps ``make``'s optimizer through the schedule: gradients as ``_has_grad`` says, and
    the state of parameter RESET dropped before step 3."""
    if params is None:
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = make(params)
    for s in steps:
        gen = torch.Generator().manual_seed(100 + s)
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen)
            p.grad = g if _has_grad(i, s) else None
        if s == 3:
            del opt.state[params[RESET]]
        opt.step()
    return params, opt


def _torch_adamw(params, **kw):
    return torch.optim.AdamW(params, foreach=False, **kw)


def _torch_counts(opt, params):
    return [int(opt.state[p]["step"]) if opt.state.get(p) else 0 for p in params]


KW = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
CONFIGS = {
    "resident": dict(),
    "resident chunked": dict(resident_chunk_bytes=2000),
    "offloaded": dict(offload=True),
    "offloaded chunked": dict(offload=True, chunk_bytes=2000),
    "partly resident": dict(offload=True, chunk_bytes=3000, resident_bytes=4000),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_adamw_counts_each_parameters_steps_as_torch(backend):
    init = _init()
    ref, ref_opt = _run(lambda ps: _torch_adamw(ps, **KW), init)
    runs = {
        name: _run(lambda ps, kw=kw: AdamW(ps, backend=backend, **KW, **kw), init)
        for name, kw in CONFIGS.items()
    }
    first = runs["resident"][0]
    for name, (params, opt) in runs.items():
        for a, b in zip(params, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=f"{name} {a.shape}")
        for a, b in zip(params, first, strict=True):  # chunking changes no bit
            assert torch.equal(a, b), (name, tuple(a.shape))
        saved = opt.state_dict()["state"]
        assert [int(saved[i]["step"]) for i in range(len(SHAPES))] == _torch_counts(ref_opt, ref)
    # The schedule gives the parameters different counts.
    assert len(set(_torch_counts(ref_opt, ref))) > 2


def _muon_groups(params):
    return [dict(params=params[:1]), dict(params=params[1:], algorithm="adamw")]


MUON_KW = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_muon_adamw_groups_count_each_parameters_steps(backend):
    """Muon's adamw groups against torch's AdamW (the Muon matrix aside), and dion's per-parameter
    ``step_dev`` in the state dict."""
    init = _init(1)
    ref, ref_opt = _run(lambda ps: _torch_adamw(ps[1:], eps=1e-8, **KW), init)
    runs = {
        name: _run(lambda ps, kw=kw: Muon(_muon_groups(ps), backend=backend, **MUON_KW, **kw), init)
        for name, kw in CONFIGS.items()
    }
    first = runs["resident"][0]
    for name, (params, opt) in runs.items():
        for a, b in zip(params[1:], ref[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=f"{name} {a.shape}")
        for a, b in zip(params, first, strict=True):
            assert torch.equal(a, b), (name, tuple(a.shape))
        saved = opt.state_dict()["state"]
        counts = [int(saved[i]["step_dev"]) for i in range(1, len(SHAPES))]
        assert counts == _torch_counts(ref_opt, ref[1:])
        assert "step_dev" not in saved[0]  # dion keeps none for Muon matrices
        assert [g["step"] for g in opt.param_groups] == [STEPS, STEPS]


# ------------------------------------------------------------------------------ checkpoints


def _saved(state_dict):
    """Through a file, as a checkpoint travels (state_dict() returns live tensors)."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("offload", [False, True])
def test_torch_checkpoint_with_unequal_counts_resumes_in_ours(offload):
    init = _init(2)
    ref, ref_opt = _run(lambda ps: _torch_adamw(ps, **KW), init, range(5))
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = AdamW(ours, offload=offload, **KW)
    opt.load_state_dict(_saved(ref_opt.state_dict()))
    saved = opt.state_dict()["state"]
    assert [int(saved[i]["step"]) for i in range(len(SHAPES))] == _torch_counts(ref_opt, ref)
    _run(None, None, range(5, STEPS), ref, ref_opt)
    _run(None, None, range(5, STEPS), ours, opt)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_our_checkpoint_with_unequal_counts_resumes_in_torch():
    init = _init(3)
    ours, opt = _run(lambda ps: AdamW(ps, offload=True, chunk_bytes=2000, **KW), init, range(5))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    ref_opt = _torch_adamw(ref, **KW)
    ref_opt.load_state_dict(_saved(opt.state_dict()))
    _run(None, None, range(5, STEPS), ref, ref_opt)
    _run(None, None, range(5, STEPS), ours, opt)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_own_checkpoint_and_copies_keep_the_counts():
    init = _init(4)
    params, opt = _run(lambda ps: Muon(_muon_groups(ps), **MUON_KW), init, range(5))
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = Muon(_muon_groups(twins), offload=True, chunk_bytes=2000, **MUON_KW)
    twin_opt.load_state_dict(_saved(opt.state_dict()))
    copies, copy_opt = copy.deepcopy((params, opt))
    for ps, o in ((params, opt), (twins, twin_opt), (copies, copy_opt)):
        _run(None, None, range(5, STEPS), ps, o)
    for a, b, c in zip(params, twins, copies, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_checkpoint_without_counts_takes_the_groups_step():
    """dion's checkpoints before its ``step_dev`` (and ours before per-parameter counts) carry
    the count in the group only: every parameter resumes from it, as dion resumes."""
    init = _init(5)
    params, opt = _run(lambda ps: Muon(_muon_groups(ps), **MUON_KW), init, range(2))
    sd = _saved(opt.state_dict())
    for values in sd["state"].values():
        values.pop("step_dev", None)
    sd["param_groups"][1]["step"] = 6
    opt.load_state_dict(sd)
    saved = opt.state_dict()["state"]
    assert [int(saved[i]["step_dev"]) for i in range(1, len(SHAPES))] == [6] * 4


@pytest.mark.parametrize("count", [-1.0, 2.5, float("nan"), "3"])
def test_bad_counts_raise_and_change_nothing(count):
    init = _init(6)
    params, opt = _run(lambda ps: AdamW(ps, **KW), init, range(2))
    good = _saved(opt.state_dict())
    bad = copy.deepcopy(good)
    bad["state"][1]["step"] = count if isinstance(count, str) else torch.tensor(count)
    before = _saved(opt.state_dict())
    with pytest.raises(ValueError, match="step"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for i, values in before["state"].items():
        for key, value in values.items():
            assert torch.equal(after["state"][i][key], value), (i, key)


# ---------------------------------------------------------------------------------- dion

DION_SHAPES = [(32, 48), (32, 48), (61,), (130,), (300,), (7,)]


def _dion():
    dion = pytest.importorskip(
        "dion",
        reason='needs dion, which is not on PyPI: pip install "git+https://github.com/microsoft/dion@0a059a4"',
    )
    # See test_vs_dion.py: dion compiles with fullgraph=True.
    torch._dynamo.config.cache_size_limit = 64
    return dion


def _dion_model(seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in DION_SHAPES]


def _dion_groups(params):
    return [dict(params=params[:2]), dict(params=params[2:], algorithm="adamw")]


def _dion_run(params, opt, steps):
    """Vector 3 (index 3) frozen at steps 1-2, vector 4 joins at step 3, vector 5's state is
    reset before step 2."""
    for s in steps:
        gen = torch.Generator().manual_seed(300 + s)
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen)
            frozen = (i == 3 and s in (1, 2)) or (i == 4 and s < 3)
            p.grad = None if frozen else g
        if s == 2:
            del opt.state[params[5]]
        opt.step()


def _dion_kw():
    from reference64 import orthogonalize64_batch

    # The same float64 orthogonalizer on both sides: they agree to fp32 rounding
    # (test_vs_dion.py measured at most 8e-7 relative).
    return dict(lr=0.02, weight_decay=0.1, newton_schulz_func=orthogonalize64_batch)


def _close_updates(ours, theirs, start):
    for a, b, x0 in zip(ours, theirs, start, strict=True):
        rel = ((a - x0) - (b - x0)).norm() / (b - x0).norm()
        assert rel < 1e-5, (tuple(a.shape), rel.item())


@pytest.mark.parametrize("kw", [dict(), dict(offload=True, chunk_bytes=2000)])
def test_muon_counts_as_dion(kw):
    dion = _dion()
    ref = _dion_model()
    start = [p.detach().clone() for p in ref]
    ref_opt = dion.Muon(_dion_groups(ref), **_dion_kw())
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    opt = Muon(_dion_groups(ours), **_dion_kw(), **kw)
    _dion_run(ref, ref_opt, range(6))
    _dion_run(ours, opt, range(6))
    _close_updates(ours, ref, start)
    theirs = [int(ref_opt.state[p]["step_dev"]) for p in ref[2:]]
    saved = opt.state_dict()["state"]
    assert [int(saved[i]["step_dev"]) for i in range(2, len(DION_SHAPES))] == theirs
    assert len(set(theirs)) > 2


def test_dion_checkpoint_with_unequal_counts_into_ours_and_back():
    dion = _dion()
    ref = _dion_model(8)
    ref_opt = dion.Muon(_dion_groups(ref), **_dion_kw())
    _dion_run(ref, ref_opt, range(4))
    ckpt = _saved(ref_opt.state_dict())
    assert len({int(v["step_dev"]) for v in ckpt["state"].values() if "step_dev" in v}) > 1
    start = [p.detach().clone() for p in ref]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    opt = Muon(_dion_groups(ours), offload=True, chunk_bytes=2000, **_dion_kw())
    opt.load_state_dict(ckpt)
    # And back: our checkpoint into a fresh dion.
    back = [torch.nn.Parameter(t.clone()) for t in start]
    back_opt = dion.Muon(_dion_groups(back), **_dion_kw())
    back_opt.load_state_dict(_saved(opt.state_dict()))
    for ps, o in ((ref, ref_opt), (ours, opt), (back, back_opt)):
        _dion_run(ps, o, range(4, 7))
    _close_updates(ours, ref, start)
    _close_updates(back, ref, start)


# ---------------------------------------------------------------------------------- graphs


@pytest.mark.parametrize("kw", [dict(), dict(offload=True, chunk_bytes=2000)])
def test_replayed_steps_read_each_parameters_count(monkeypatch, kw):
    """Steps replayed from a graph after a parameter skipped two steps match torch's AdamW:
    the replay reads each step's counts from the scalar table. The stand-in graph does what a
    CUDA graph does (tests/_graph_emulator.py: a replay reruns the recorded launches, not the
    step's Python), and backward's gradients are fresh tensors every step."""
    from _graph_emulator import RecordingGraph

    from muon_offload.engine import capture_rules
    from muon_offload.engine.graphs import StepGraphs

    init = _init(9)
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = _torch_adamw(ref, **KW)
    opt = AdamW(ours, backend="triton", cuda_graph=False, **KW, **kw)
    monkeypatch.setattr(capture_rules, "check_device", lambda cuda_graph, device: None)
    opt.cuda_graph = True  # the CPU stands in for the GPU
    made = []
    opt._graphing.graphs = StepGraphs(
        torch.device("cpu"), lambda: made.append(RecordingGraph()) or made[-1]
    )
    for s in range(10):
        gen = torch.Generator().manual_seed(400 + s)
        for i, (p, q) in enumerate(zip(ours, ref, strict=True)):
            g = torch.randn(p.shape, generator=gen)
            frozen = i == FROZEN and s in (2, 3)
            p.grad, q.grad = (None, None) if frozen else (g, g.clone())
        opt.step()
        ref_opt.step()
    assert opt.graph_stats()["replays"] >= 3
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
