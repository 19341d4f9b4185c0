"""Hostile-user cases: parameters that change under the optimizer, dtypes the
kernels cannot serve, errors and interrupts mid-step, and arguments of the wrong type. Each
raises clearly with everything untouched, or works."""

import numpy as np
import pytest
import torch

from muon_offload import AdamW, Muon, StepInterrupted
from muon_offload.engine import host_slabs
from muon_offload.optim.elementwise import AdamWUpdate


def _params(seed=0, shapes=((37, 19), (21, 45), (101,))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(500 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _muon(params, **kw):
    return Muon([dict(params=params[:2]), dict(params=params[2:], algorithm="adamw")], **kw)


def _snapshot(params, opt):
    return (
        [p.detach().clone() for p in params],
        {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
        [g["step"] for g in opt.param_groups],
    )


def _assert_same(params, opt, snap):
    weights, state, steps = snap
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k])
    assert [g["step"] for g in opt.param_groups] == steps


# --------------------------------------------------------- parameters that change


@pytest.mark.parametrize("offload", [False, True])
def test_parameter_that_grows_is_refused_then_restarts(offload):
    params = _params()
    opt = _muon(params, offload=offload, chunk_bytes=3000)
    _grads(params, 0)
    opt.step()
    params[2].data = torch.randn(200)
    _grads(params, 1)
    snap = _snapshot(params, opt)
    with pytest.raises(ValueError, match=r"changed shape.*del opt.state"):
        opt.step()
    _assert_same(params, opt, snap)
    del opt.state[params[2]]
    before = params[2].detach().clone()
    opt.step()
    assert (params[2] != before).all()  # every element updated, not half of them


@pytest.mark.parametrize("offload", [False, True])
def test_parameter_with_new_storage_same_shape_is_updated(offload):
    params = _params()
    opt = _muon(params, offload=offload)
    _grads(params, 0)
    opt.step()
    fresh = torch.randn(37, 19)
    params[0].data = fresh.clone()
    _grads(params, 1)
    opt.step()
    assert not torch.equal(params[0].detach(), fresh)
    assert params[0].data_ptr() != 0


# ------------------------------------------------------------------------- dtypes


def test_float64_parameters_are_refused_at_construction():
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64"):
        Muon([p])
    with pytest.raises(ValueError, match="float64"):
        AdamW([p])


def test_parameter_turned_float64_is_refused_at_step():
    params = _params()
    opt = _muon(params)
    _grads(params, 0)
    opt.step()
    params[2].data = params[2].data.double()
    _grads(params, 1)
    snap = _snapshot(params, opt)
    with pytest.raises(ValueError, match="float64"):
        opt.step()
    _assert_same(params, opt, snap)


def test_float16_parameters_keep_float32_state_and_match_torch():
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(513, generator=gen)
    ours = torch.nn.Parameter(init.half())
    ref = torch.nn.Parameter(init.clone())  # torch in fp32: what the fp16 run should track
    opt = AdamW([ours], lr=1e-3)
    ref_opt = torch.optim.AdamW([ref], lr=1e-3)
    for _ in range(5):
        # Small gradients: g^2 underflows fp16 (below 6e-8), so fp16 variance gave updates
        # ~100 x too large.
        g = 1e-4 * torch.randn(513, generator=gen)
        ours.grad, ref.grad = g.half(), g.half().float()
        opt.step()
        ref_opt.step()
    assert opt.state[ours]["exp_avg_sq"].dtype == torch.float32
    # fp16 weights: one rounding of the fp32 result (relative 2^-11) on top of torch's value.
    torch.testing.assert_close(ours.float(), ref.detach(), rtol=2e-3, atol=1e-4)


# ---------------------------------------------------------------- errors mid-step


def test_failed_pinned_allocation_leaves_step_count(monkeypatch):
    params = _params()

    def refuse(self, nbytes):
        raise MemoryError("no pinned memory")

    with monkeypatch.context() as m:
        m.setattr(host_slabs.HostSlabs, "_new_slab", refuse)
        with pytest.raises(MemoryError):
            _muon(params, offload=True)  # state is made at construction
    opt = _muon(params, offload=True)
    held = [opt.state.pop(p) for p in params]  # made afresh by the next step, in new slabs
    _grads(params, 0)
    with monkeypatch.context() as m:
        m.setattr(host_slabs.HostSlabs, "_new_slab", refuse)
        with pytest.raises(MemoryError):
            opt.step()
    assert [g["step"] for g in opt.param_groups] == [0, 0]
    del held
    # Then it works, and the first AdamW update is a first step's (bias-corrected, lr size).
    before = params[2].detach().clone()
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [1, 1]
    move = (params[2] - before * (1 - 0.01 * 0.01)).abs()
    torch.testing.assert_close(move, torch.full_like(move, 0.01), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("offload", [False, True])
def test_keyboard_interrupt_rolls_back_and_reports(monkeypatch, offload):
    params = _params()
    opt = _muon(params, offload=offload)
    _grads(params, 0)
    opt.step()
    _grads(params, 1)
    snap = _snapshot(params, opt)

    def interrupt(self, job):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(AdamWUpdate, "update", interrupt)
        with pytest.raises(KeyboardInterrupt) as info:
            opt.step()
    report = info.value.step_interrupted
    assert isinstance(report, StepInterrupted)
    assert {id(p) for p in report.updated} == {id(params[0]), id(params[1])}
    assert [id(p) for p in report.torn] == [id(params[2])]
    # The adamw group saw no completed update: its count is as before.
    assert [g["step"] for g in opt.param_groups] == [snap[2][0] + 1, snap[2][1]]
    assert torch.equal(params[2], snap[0][2])


def test_elementwise_unit_failing_part_way_is_torn_not_as_before(monkeypatch):
    # An adamw unit whose first segment was updated before the failure (as when a second
    # kernel launch of a mixed-dtype unit fails): it must not be reported "as before".
    params = _params(shapes=((37, 19), (21, 45), (101,), (7,)))
    opt = _muon(params)
    _grads(params, 0)
    original = AdamWUpdate.update

    def half_then_fail(self, job):
        first = type(job)(
            **{
                **job.__dict__,
                "params": job.params[:1],
                "grads": job.grads[:1],
                "state": [s[:1] for s in job.state],
            }
        )
        original(self, first)
        raise RuntimeError("second launch failed")

    monkeypatch.setattr(AdamWUpdate, "update", half_then_fail)
    with pytest.raises(StepInterrupted) as info:
        opt.step()
    err = info.value
    torn = {id(p) for p in err.torn}
    assert torn == {id(params[2]), id(params[3])}
    assert not torn & {id(p) for p in err.not_updated}
    assert "partly updated" in str(err)


# ------------------------------------------------------------------ argument types


def test_constructor_arguments_are_checked_up_front():
    params = _params()
    with pytest.raises(ValueError, match="offload"):
        _muon(params, offload="no")
    with pytest.raises(ValueError, match="betas"):
        Muon(params[:2], betas=(0.9, 1.5))  # no adamw group: checked at construction anyway
    opt = _muon(params, chunk_bytes=np.int64(4096), resident_bytes=np.int32(0))
    assert type(opt.chunk_bytes) is int and opt.chunk_bytes == 4096


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_contiguous_gradients(backend):
    params = _params(shapes=((24, 40), (40, 24), (96,)))
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opts = [_muon(ps, backend=backend) for ps in (params, twins)]
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(tuple(reversed(p.shape)), generator=gen).T for p in params[:2]]
    grads.append(torch.randn(192, generator=gen)[::2])
    for p, q, g in zip(params, twins, grads, strict=True):
        assert not g.is_contiguous()
        p.grad, q.grad = g, g.contiguous()
    for opt in opts:
        opt.step()
    for p, q in zip(params, twins, strict=True):
        assert torch.equal(p, q)
