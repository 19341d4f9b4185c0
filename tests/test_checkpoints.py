"""Checkpoints of every configuration save, load and resume: ``torch.save`` (also with
``weights_only`` loading) and ``torch.distributed.checkpoint``, compactly; torch's AdamW
checkpoints both ways; a state dict that does not fit leaves the optimizer untouched; and
``copy.deepcopy`` / ``pickle`` / ``torch.save(opt)`` give a working optimizer."""

import copy
import io
import pickle

import pytest
import torch

from muon_offload import AdamW, Muon

# Odd sizes; bf16 matrices beside fp32 vectors (a bf16 model with fp32 norms).
SHAPES = [(37, 19), (37, 19), (21, 45), (1031,), (5,)]
DTYPES = [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]


def _model(seed=0, dtypes=DTYPES):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(d))
        for s, d in zip(SHAPES, dtypes, strict=True)
    ]


def _muon(params, **kw):
    return Muon(
        [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw")], lr=0.02, **kw
    )


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _steps(params, opt, start, count):
    for s in range(start, start + count):
        _grads(params, s)
        opt.step()


def _state_bytes(opt):
    return sum(
        t.numel() * t.element_size()
        for values in opt.state.values()
        for t in values.values()
        if torch.is_tensor(t)
    )


CONFIGS = [dict(), dict(offload=True), dict(offload=True, chunk_bytes=600)]


@pytest.mark.parametrize("kw", CONFIGS)
def test_torch_save_mixed_dtypes_compact_weights_only(kw):
    params = _model()
    opt = _muon(params, **kw)
    _steps(params, opt, 0, 2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    # Every tensor's own bytes, and no slab: within a few KiB of pickling overhead.
    assert len(buf.getvalue()) < _state_bytes(opt) + 8 * 1024
    # One state tensor saves its own bytes, not the slab it lives in.
    one = io.BytesIO()
    torch.save(opt.state_dict()["state"][3]["variance"], one)
    assert len(one.getvalue()) < 1031 * 4 + 2048
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    # Resume into a fresh optimizer: bitwise the same as the uninterrupted one.
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = _muon(params2, **kw)
    opt2.load_state_dict(loaded)
    _steps(params, opt, 2, 2)
    _steps(params2, opt2, 2, 2)
    for a, b in zip(params, params2, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw", CONFIGS[:2])
def test_distributed_checkpoint_round_trip(kw, tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    params = _model()
    opt = _muon(params, **kw)
    _steps(params, opt, 0, 2)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path))
    on_disk = sum(f.stat().st_size for f in tmp_path.iterdir())
    assert on_disk < _state_bytes(opt) + 64 * 1024
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = _muon(params2, **kw)
    _steps(params2, opt2, 50, 1)  # state to be overwritten
    for p, q in zip(params2, params, strict=True):
        p.data.copy_(q)
    target = {"optim": opt2.state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path))
    opt2.load_state_dict(target["optim"])
    _steps(params, opt, 2, 1)
    _steps(params2, opt2, 2, 1)
    for a, b in zip(params, params2, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ torch's AdamW both ways

ADAMW_SHAPES = [(37, 19), (1031,), (3, 5, 7)]


def _adamw_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ADAMW_SHAPES]


# As tests/test_vs_torch_adamw.py: the same formula, a few fp32 roundings apart.
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("offload", [False, True])
def test_torch_adamw_checkpoint_resumes_in_ours(offload):
    kw = dict(lr=1e-2, weight_decay=0.1)
    ref = _adamw_params()
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    _steps(ref, ref_opt, 0, 3)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = AdamW(ours, offload=offload, **kw)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    assert opt.param_groups[0]["step"] == 3
    _steps(ref, ref_opt, 3, 2)
    _steps(ours, opt, 3, 2)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_our_adamw_checkpoint_resumes_in_torch():
    kw = dict(lr=1e-2, weight_decay=0.1)
    ours = _adamw_params()
    opt = AdamW(ours, offload=True, **kw)
    _steps(ours, opt, 0, 3)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _steps(ours, opt, 3, 2)
    _steps(ref, ref_opt, 3, 2)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    # Our state_dict() hands out new inner dicts: the live state gains no "step" key.
    assert all("step" not in values for values in opt.state.values())


def test_torch_adamw_checkpoint_with_unequal_steps_keeps_each_count():
    ref = _adamw_params()
    ref_opt = torch.optim.AdamW(ref, foreach=False)
    _steps(ref, ref_opt, 0, 2)
    ref[1].grad = None
    ref_opt.step()  # parameter 1 stays at 2 steps, the others reach 3
    opt = AdamW([torch.nn.Parameter(p.detach().clone()) for p in ref])
    opt.load_state_dict(ref_opt.state_dict())
    assert opt.param_groups[0]["step"] == 3  # the group counts step() calls: the largest
    saved = opt.state_dict()["state"]
    assert [int(saved[i]["step"]) for i in saved] == [
        int(s["step"]) for s in ref_opt.state.values()
    ]
    assert int(saved[1]["step"]) == 2


# ------------------------------------------------------- bad state dicts change nothing


def _snapshot(opt):
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return groups, state


def _assert_unchanged(opt, snap):
    groups, state = snap
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k])


def _bad_dicts(good):
    def edit(fn):
        sd = copy.deepcopy(good)
        fn(sd)
        return sd

    return {
        "algorithm": edit(lambda sd: sd["param_groups"][1].update(algorithm="lion")),
        "shape": edit(lambda sd: sd["state"][0].update(momentum=torch.randn(19, 37))),
        "int64": edit(lambda sd: sd["state"][0].update(momentum=torch.ones(37, 19).long())),
        "float64": edit(lambda sd: sd["state"][0].update(momentum=torch.randn(37, 19).double())),
        "missing key": edit(lambda sd: sd["state"][3].pop("variance")),
        "unknown id": edit(lambda sd: sd["state"].update({99: sd["state"][0]})),
        "group count": edit(lambda sd: sd["param_groups"].pop()),
        "no state": {"param_groups": good["param_groups"]},
        "state not a dict": edit(lambda sd: sd["state"].update({0: [1, 2]})),
        "group not a dict": edit(lambda sd: sd["param_groups"].__setitem__(0, "x")),
        "not a dict": [1, 2, 3],
    }


@pytest.mark.parametrize("offload", [False, True])
def test_bad_state_dicts_raise_and_change_nothing(offload):
    params = _model()
    opt = _muon(params, offload=offload)
    _steps(params, opt, 0, 2)
    good = copy.deepcopy(opt.state_dict())
    snap = _snapshot(opt)
    for name, bad in _bad_dicts(good).items():
        with pytest.raises(ValueError):
            opt.load_state_dict(bad)
        _assert_unchanged(opt, snap)
        assert name  # for the traceback
    _steps(params, opt, 2, 1)  # and it still steps


@pytest.mark.parametrize("offload", [False, True])
def test_reloading_own_state_dict_with_entries_swapped(offload):
    params = _model(dtypes=[torch.float32] * 5)
    opt = _muon(params, offload=offload)
    _steps(params, opt, 0, 2)
    a, b = (opt.state[params[i]]["momentum"].clone() for i in (0, 1))
    sd = opt.state_dict()  # live tensors, not copies
    sd["state"][0], sd["state"][1] = sd["state"][1], sd["state"][0]
    opt.load_state_dict(sd)
    assert torch.equal(opt.state[params[0]]["momentum"], b)
    assert torch.equal(opt.state[params[1]]["momentum"], a)


# ------------------------------------------------------------------ copies of an optimizer


def _roundtrips():
    def via_torch_save(obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    return {
        "deepcopy": copy.deepcopy,
        "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
        "torch.save": via_torch_save,
    }


@pytest.mark.parametrize("how", list(_roundtrips()))
@pytest.mark.parametrize("kw", CONFIGS)
def test_copied_optimizer_steps_like_the_original(how, kw):
    params = _model()
    opt = _muon(params, **kw)
    _steps(params, opt, 0, 2)
    # Copy the parameters with the optimizer, as a training script's checkpoint would.
    params2, opt2 = _roundtrips()[how]((params, opt))
    assert opt2.param_groups[0]["params"][0] is params2[0]
    _steps(params, opt, 2, 2)
    _steps(params2, opt2, 2, 2)
    for a, b in zip(params, params2, strict=True):
        assert torch.equal(a, b)
    assert opt2.offload == opt.offload and opt2.chunk_bytes == opt.chunk_bytes


def _extra(opt):
    """A state-dict pre-hook's entry that names no parameter (torch carries such keys)."""
    opt.state["extra"] = {"note": torch.tensor([1.0, 2.0]), "count": 3}


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("make", ["ours", "torch"])
def test_non_parameter_state_keys_are_carried_as_torch_carries_them(make, offload):
    kw = dict(lr=1e-2, weight_decay=0.1)
    ref = _adamw_params()
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = AdamW(ours, offload=offload, **kw)
    for o, ps in ((ref_opt, ref), (opt, ours)):
        o.register_state_dict_pre_hook(_extra)
        _steps(ps, o, 0, 2)
    saved = {"ours": opt, "torch": ref_opt}[make].state_dict()
    assert saved["state"].keys() == ref_opt.state_dict()["state"].keys()
    assert saved["state"]["extra"]["count"] == 3
    for o in (
        AdamW([torch.nn.Parameter(p.detach().clone()) for p in ref], offload=offload, **kw),
        torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ref], **kw),
    ):
        o.load_state_dict(copy.deepcopy(saved))
        assert o.state["extra"]["count"] == 3
        assert torch.equal(o.state["extra"]["note"], torch.tensor([1.0, 2.0]))
        if isinstance(o, AdamW):
            assert copy.deepcopy(o).state["extra"]["count"] == 3
            o.load_state_dict(o.state_dict())  # its own live tensors, the entry's too
    # Every step of ours still follows torch's.
    _steps(ref, ref_opt, 2, 2)
    _steps(ours, opt, 2, 2)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_non_parameter_state_keys_in_muon():
    params = _model()
    opt = _muon(params, offload=True)
    _steps(params, opt, 0, 1)
    opt.register_state_dict_pre_hook(_extra)
    saved = opt.state_dict()
    opt2 = _muon([torch.nn.Parameter(p.detach().clone()) for p in params], offload=True)
    opt2.load_state_dict(saved)
    assert opt2.state["extra"]["count"] == 3
    _steps(params, opt2, 1, 1)
    with pytest.raises(ValueError, match="names parameter 9, which no group lists"):
        opt2.load_state_dict({**saved, "state": {**saved["state"], 9: {}}})


@pytest.mark.parametrize("how", list(_roundtrips()))
@pytest.mark.parametrize(
    "make", [lambda ps: AdamW(ps[3:]), lambda ps: _muon(ps)], ids=["adamw", "muon"]
)
def test_copy_gains_no_attributes(how, make):
    """A copy has what the original has: AdamW's algorithms stay its class's, Muon's (which
    hold its orthogonalizer) its own."""
    params = _model()
    opt = make(params)
    _steps(params, opt, 0, 1)
    copied = _roundtrips()[how]((params, opt))[1]
    assert set(vars(copied)) <= set(vars(opt))
    assert ("algorithms" in vars(copied)) == ("algorithms" in vars(opt))
    assert copied.algorithms.keys() == opt.algorithms.keys()


def test_8bit_checkpoint_reaches_torch_through_a_dense_optimizer():
    """torch's AdamW reads dense state only (an 8-bit checkpoint holds ``exp_avg_codes`` and
    ``exp_avg_scales``). The conversion docs/usage.md gives: load it into ours with dense
    state and save that; torch resumes from it as ours does."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    # 64 x 80 is over the 4,096 elements below which 8-bit state stays fp32.
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(64, 80), (1031,)]]
    quantized = AdamW(params, state_dtype=torch.int8, **kw)
    _steps(params, quantized, 0, 3)
    saved = copy.deepcopy(quantized.state_dict())
    assert "exp_avg_codes" in saved["state"][0] and "exp_avg" not in saved["state"][0]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in params]
    dense = AdamW(ours, **kw)
    dense.load_state_dict(saved)
    converted = copy.deepcopy(dense.state_dict())
    assert set(converted["state"][0]) == {"exp_avg", "exp_avg_sq", "step"}
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    ref_opt.load_state_dict(converted)
    _steps(ours, dense, 3, 2)
    _steps(ref, ref_opt, 3, 2)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
