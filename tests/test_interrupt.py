"""An exception inside the pipeline: every parameter ends either fully updated or exactly as
before the step, the error says which, and the next step() works."""

import pytest
import torch

from muon_offload import Muon, StepInterrupted
from muon_offload.optim.elementwise import AdamWUpdate, LionUpdate
from muon_offload.optim.muon import MuonUpdate

SHAPES = [(24, 40), (24, 40), (40, 24), (3, 8, 12), (16, 16), (77,), (300,), (5,)]


def _make(offload):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    groups = [
        dict(params=params[:5]),
        dict(params=params[5:7], algorithm="adamw"),
        dict(params=params[7:], algorithm="lion"),
    ]
    kwargs = dict(offload=True, chunk_bytes=4000) if offload else dict(chunk_bytes=4000)
    return params, Muon(groups, lr=0.05, **kwargs)


def _grads(params, step):
    gen = torch.Generator().manual_seed(10 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _snapshot(params, opt):
    return [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]


def _inject(monkeypatch, method, fail_at):
    """Fail the ``fail_at``-th unit update of Muon units or of element-wise units."""
    calls = {"n": 0}
    classes = (MuonUpdate,) if method == "_muon_task" else (AdamWUpdate, LionUpdate)
    for cls in classes:
        original = cls.update

        def failing(self, job, original=original):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise RuntimeError("injected failure")
            return original(self, job)

        monkeypatch.setattr(cls, "update", failing)


@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize(
    "method,fail_at",
    [("_muon_task", 1), ("_muon_task", 3), ("_update_elementwise", 1), ("_update_elementwise", 2)],
)
def test_interrupted_step_leaves_each_parameter_before_or_after(
    monkeypatch, offload, method, fail_at
):
    # The step every parameter would get without the failure.
    ref_params, ref_opt = _make(offload)
    _grads(ref_params, 0)
    ref_opt.step()
    _grads(ref_params, 1)
    ref_opt.step()
    after = _snapshot(ref_params, ref_opt)

    params, opt = _make(offload)
    _grads(params, 0)
    opt.step()
    before = _snapshot(params, opt)
    steps_before = [g["step"] for g in opt.param_groups]
    _grads(params, 1)
    with monkeypatch.context() as m:
        _inject(m, method, fail_at)
        with pytest.raises(StepInterrupted, match="injected failure") as info:
            opt.step()
    err = info.value
    now = _snapshot(params, opt)
    updated = {id(p) for p in err.updated}
    not_updated = {id(p) for p in err.not_updated}
    partial = {id(p) for p in err.partial}
    # A unit that had started when the failure came may be part-way (weights are updated in
    # place): it is reported as torn, apart from the other three. Here the failure came
    # before it touched anything, so it must still read exactly as before.
    torn = {id(p) for p in err.torn}
    assert torn and not torn & (updated | not_updated | partial)
    assert updated | not_updated | partial | torn == {id(p) for p in params}
    for p, (x, state), (x0, s0), (x1, s1) in zip(params, now, before, after, strict=True):
        if id(p) in partial | torn:
            # Element by element, weight and state together: all updated or all as before
            # (a torn unit failed before touching anything here).
            done = x == x1
            assert id(p) in torn or (done.any() and not done.all()), tuple(p.shape)
            assert torch.equal(x[~done], x0[~done])
            for key in state:
                assert torch.equal(state[key][done], s1[key][done])
                assert torch.equal(state[key][~done], s0[key][~done])
            continue
        want_x, want_s = (x1, s1) if id(p) in updated else (x0, s0)
        assert torch.equal(x, want_x), tuple(p.shape)
        for key in state:
            assert torch.equal(state[key], want_s[key]), (tuple(p.shape), key)
    # Groups that saw no update keep their step count.
    for g, before_step in zip(opt.param_groups, steps_before, strict=True):
        stepped = any(id(p) in updated | partial for p in g["params"])
        assert g["step"] == before_step + (1 if stepped else 0)
    # The next step works and updates everything that has a gradient.
    _grads(params, 2)
    mid = _snapshot(params, opt)
    opt.step()
    for p, (x, _) in zip(params, mid, strict=True):
        assert not torch.equal(p, x)


@pytest.mark.parametrize("offload", [True, False])
def test_interrupted_step_keeps_the_counts_of_what_it_did_not_update(monkeypatch, offload):
    """AdamW counts each parameter's steps (as torch): a parameter the interrupted step did not
    update keeps its count, in the state dict and in its next bias correction."""
    from muon_offload import AdamW

    def make():
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(200, generator=gen)) for _ in range(4)]
        kw = dict(offload=True) if offload else {}
        # A chunk a parameter (8 bytes of state an element): the third fails, the fourth
        # does not run.
        return params, AdamW(params, lr=1e-2, chunk_bytes=1600, resident_chunk_bytes=1600, **kw)

    params, opt = make()
    _grads(params, 0)
    opt.step()
    _grads(params, 1)
    with monkeypatch.context() as m:
        _inject(m, "_update_elementwise", 3)  # the third chunk's unit
        with pytest.raises(StepInterrupted) as info:
            opt.step()
    err = info.value
    assert err.updated and err.not_updated
    saved = opt.state_dict()["state"]
    for i, p in enumerate(params):
        stepped = any(p is q for q in err.updated + err.partial)
        assert int(saved[i]["step"]) == (2 if stepped else 1), i
    # The next step continues each parameter's count as torch would: a twin that skipped the
    # interrupted step's parameters (grad None) lands on the same bits for them.
    twins, twin_opt = make()
    _grads(twins, 0)
    twin_opt.step()
    _grads(params, 2)
    opt.step()
    for p, t in zip(params, twins, strict=True):
        t.grad = p.grad.clone()
    twin_opt.step()
    for p, t in zip(params, twins, strict=True):
        if any(p is q for q in err.not_updated):
            assert torch.equal(p, t)
