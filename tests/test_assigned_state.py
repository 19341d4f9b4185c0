"""State assigned between steps (``opt.state[p] = {...}``, ``opt.state[p][name] = t``), as
torch's optimizers allow: the next step uses the values assigned, not the tensors they
replaced (the cached plan named those). Resident state adopts the assigned tensor and updates
it in place, as torch does; streamed state copies the values into its pinned slabs. Each is
compared with a twin that received the same values through ``load_state_dict``."""

from __future__ import annotations

import copy

import pytest
import torch

from muon_offload import Muon

SHAPES = ((8, 16), (8, 16), (3, 8, 16), (50,), (4500,))
MODES = [
    dict(backend="torch"),
    dict(backend="torch", offload=True, chunk_bytes=4096),
    dict(backend="triton"),
    dict(backend="triton", offload=True, chunk_bytes=4096, state_dtype=torch.int8),
]
IDS = ["resident", "offload", "triton", "triton-offload-int8"]


def _model():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _opt(params, kw):
    groups = [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw", lr=1e-3)]
    return Muon(groups, lr=0.02, weight_decay=0.1, **kw)


def _step(opt, params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def _pair(kw):
    """Two optimizers at the same point after two steps."""
    a, b = _model(), _model()
    opt_a, opt_b = _opt(a, kw), _opt(b, kw)
    for seed in (1, 2):
        _step(opt_a, a, seed)
        _step(opt_b, b, seed)
    return (a, opt_a), (b, opt_b)


def _scrambled(state: dict) -> dict:
    """Other values of the same shapes and dtypes (8-bit codes stay valid codes)."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    for k, v in state.items():
        if v.is_floating_point():
            out[k] = (v + torch.rand(v.shape, generator=gen).to(v.dtype)).abs()
        else:
            out[k] = v.flip(-1).clone()
    return out


def _assert_same(a, opt_a, b, opt_b):
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for k in opt_a.state[p]:
            assert torch.equal(opt_a.state[p][k], opt_b.state[q][k]), k


@pytest.mark.parametrize("kw", MODES, ids=IDS)
@pytest.mark.parametrize("whole_dict", [True, False], ids=["dict", "tensor"])
def test_assigned_state_is_what_the_next_step_uses(kw, whole_dict):
    (a, opt_a), (b, opt_b) = _pair(kw)
    saved = opt_b.state_dict()
    new = {}
    for i, p in enumerate(a[::2]):
        new[p] = _scrambled(opt_a.state[p])
        saved["state"][2 * i] = {**saved["state"][2 * i], **copy.deepcopy(new[p])}
    for p, values in new.items():
        if whole_dict:
            opt_a.state[p] = dict(values)
        else:
            for k, v in values.items():
                opt_a.state[p][k] = v
    opt_b.load_state_dict(saved)
    for seed in (3, 4):
        _step(opt_a, a, seed)
        _step(opt_b, b, seed)
    _assert_same(a, opt_a, b, opt_b)
    if not kw.get("offload"):  # resident: the tensors assigned are the state, updated in place
        for p, values in new.items():
            for k, v in values.items():
                assert opt_a.state[p][k] is v


@pytest.mark.parametrize("kw", MODES[:2], ids=IDS[:2])
def test_a_bad_assignment_is_refused_before_anything_changes(kw):
    (a, opt_a), _ = _pair(kw)
    before = [p.detach().clone() for p in a]
    values = {p: {k: v.clone() for k, v in opt_a.state[p].items()} for p in a}
    opt_a.state[a[0]]["momentum"] = torch.zeros(3, 3)
    gen = torch.Generator().manual_seed(5)
    for p in a:
        p.grad = torch.randn(p.shape, generator=gen)
    with pytest.raises(ValueError, match="momentum.*shape"):
        opt_a.step()
    for p, x in zip(a, before, strict=True):
        assert torch.equal(p, x)
    for p in a[1:]:
        for k, v in opt_a.state[p].items():
            assert torch.equal(v, values[p][k])
    opt_a.state[a[0]]["momentum"] = values[a[0]]["momentum"]  # put right: steps again
    opt_a.step()


def test_a_missing_name_is_refused():
    (a, opt_a), _ = _pair(MODES[0])
    del opt_a.state[a[3]]["exp_avg_sq" if "exp_avg_sq" in opt_a.state[a[3]] else "variance"]
    gen = torch.Generator().manual_seed(5)
    for p in a:
        p.grad = torch.randn(p.shape, generator=gen)
    with pytest.raises(ValueError, match="missing.*del opt.state"):
        opt_a.step()
