"""What a step caches between steps (the plan, its transfers and chunk layouts, the staging
views) is dropped or bypassed whenever what it depends on changes: after each change, a step
of the optimizer that has run before equals, bit for bit, the step of a fresh copy that has
no cache (``copy.deepcopy`` builds its state, plans and staging from scratch)."""

import copy
import gc
import weakref

import pytest
import torch

from muon_offload import Muon


def _params(shapes=((37, 19), (37, 19), (37, 45), (101,), (300,)), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _muon(params, offload, **kw):
    # Small chunks: several streamed chunks, element-wise parameters cut across them.
    return Muon(
        [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw", lr=3e-3)],
        offload=offload,
        chunk_bytes=6000,
        resident_chunk_bytes=12000,
        backend="torch",
        **kw,
    )


def _flat(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _step_matches_fresh(opt):
    """Step ``opt`` and a fresh copy of it; both must give the same weights and state."""
    fresh = copy.deepcopy(opt)
    for p, q in zip(_flat(opt), _flat(fresh), strict=True):
        q.grad = None if p.grad is None else p.grad.clone()  # deepcopy leaves grads behind
    opt.step()
    fresh.step()
    for p, q in zip(_flat(opt), _flat(fresh), strict=True):
        assert torch.equal(p.detach(), q.detach())
        for (k, v), (k2, v2) in zip(opt.state[p].items(), fresh.state[q].items(), strict=True):
            assert k == k2 and torch.equal(v, v2), k
    assert [g["step"] for g in opt.param_groups] == [g["step"] for g in fresh.param_groups]


def _run(offload, change, steps=2, **kw):
    params = _params()
    opt = _muon(params, offload, **kw)
    for s in range(steps):
        _grads(params, s)
        opt.step()
    change(opt, params)
    _step_matches_fresh(opt)
    return opt, params


OFFLOAD = pytest.mark.parametrize("offload", [False, True])


@OFFLOAD
def test_nothing_changed(offload):
    _run(offload, lambda opt, params: _grads(params, 7))


@OFFLOAD
def test_hyper_parameters_changed(offload):
    def change(opt, params):
        opt.param_groups[0]["lr"] = 0.05
        opt.param_groups[0]["weight_decay"] = 0.2
        opt.param_groups[1]["lr"] = 1e-2
        opt.param_groups[1]["beta2"] = 0.9
        _grads(params, 7)

    opt, params = _run(offload, change)
    # And the new values are the ones used: the same step at the old lr differs.
    _grads(params, 8)
    other = copy.deepcopy(opt)
    for p, q in zip(_flat(opt), _flat(other), strict=True):
        q.grad = p.grad.clone()
    other.param_groups[0]["lr"] = 0.01
    opt.step()
    other.step()
    assert not torch.equal(params[0].detach(), _flat(other)[0].detach())


@OFFLOAD
def test_group_layout_changed(offload):
    """flatten / split_sizes change how a Muon unit is orthogonalized: a new plan."""

    def change(opt, params):
        opt.param_groups[0]["split_sizes"] = (17, 20)
        opt.param_groups[0]["adjust_lr"] = "rms_norm"
        _grads(params, 7)

    _run(offload, change)


@OFFLOAD
def test_param_group_added(offload):
    def change(opt, params):
        extra = _params(((64, 48), (64, 48), (700,)), seed=1)
        opt.add_param_group(dict(params=extra[:2]))
        opt.add_param_group(dict(params=extra[2:], algorithm="lion", lr=1e-3))
        params.extend(extra)
        _grads(params, 7)

    opt, params = _run(offload, change)
    assert all(opt.state[p] for p in params)


@OFFLOAD
def test_gradients_come_and_go(offload):
    def change(opt, params):
        _grads(params, 7)
        params[1].grad = None
        params[4].grad = None

    opt, params = _run(offload, change)
    _grads(params, 8)  # all back: the first plan again
    _step_matches_fresh(opt)


@OFFLOAD
def test_parameter_storage_replaced(offload):
    """``p.data = ...`` with the same shape keeps the plan, not views of the old storage."""

    def change(opt, params):
        params[0].data = torch.randn(37, 19)
        params[4].data = torch.randn(300)
        _grads(params, 7)

    opt, params = _run(offload, change)
    old = params[4].detach().clone()
    _grads(params, 8)
    opt.step()
    assert not torch.equal(params[4].detach(), old)


@OFFLOAD
def test_parameter_shape_changed_then_state_reset(offload):
    def change(opt, params):
        params[4].data = torch.randn(500)
        _grads(params, 7)
        with pytest.raises(ValueError, match="changed shape"):
            opt.step()
        del opt.state[params[4]]

    _run(offload, change)


@OFFLOAD
def test_state_loaded(offload):
    def change(opt, params):
        other = _muon(_params(seed=3), offload)
        for s in range(3):
            _grads(_flat(other), 20 + s)
            other.step()
        opt.load_state_dict(other.state_dict())
        _grads(params, 7)

    _run(offload, change)


@OFFLOAD
def test_state_deleted(offload):
    def change(opt, params):
        del opt.state[params[1]]
        del opt.state[params[3]]
        _grads(params, 7)

    _run(offload, change)


def test_chunk_budgets_changed():
    def change(opt, params):
        opt.reconfigure(chunk_bytes=1024, resident_chunk_bytes=8192)
        _grads(params, 7)

    _run(True, change)


def test_int8_state():
    def change(opt, params):
        opt.param_groups[1]["lr"] = 1e-2
        _grads(params, 7)

    _run(True, change, state_dtype=torch.int8)


@OFFLOAD
def test_cached_plan_holds_no_gradient(offload):
    """The step's checks keep what they read (``StepWork``) for the keys; the plan cache must
    not keep the gradients of the step that planned alive after ``zero_grad()``."""
    params = _params()
    opt = _muon(params, offload)
    _grads(params, 0)
    opt.step()
    grads = [weakref.ref(p.grad) for p in params]
    opt.zero_grad()
    gc.collect()
    assert all(g() is None for g in grads)


# Two expert-like stacks of matrices (Muon cuts each into its matrices), a matrix, AdamW.
STACKS = ((3, 8, 6), (3, 8, 6), (8, 6), (101,), (300,))


@OFFLOAD
@pytest.mark.parametrize("state_dtype", [None, torch.int8])
def test_stack_storage_replaced(offload, state_dtype):
    """A resident stack's matrices, kept from one step to the next (``UnitJob.memo``), follow
    ``p.data = ...``: the step updates the new storage, as a fresh copy's does."""
    kw = {} if state_dtype is None else dict(state_dtype=state_dtype)
    params = _params(STACKS)
    opt = _muon(params, offload, **kw)
    for s in range(2):
        _grads(params, s)
        opt.step()
    params[0].data = torch.randn(3, 8, 6)
    _grads(params, 7)
    new = params[0].detach().clone()
    _step_matches_fresh(opt)
    assert not torch.equal(params[0].detach(), new)
    _grads(params, 8)
    _step_matches_fresh(opt)


@OFFLOAD
@pytest.mark.parametrize("state_dtype", [None, torch.int8])
def test_steady_step_cuts_only_the_gradients(offload, state_dtype):
    """After the first step only the gradients (new every step) are cut into matrices: the
    parameters' and the momentum's matrices (8-bit: with their rows of scales) are kept, with the
    plan where the state is resident, with the chunk's staging views where it is streamed;
    the steps stay bitwise those of an optimizer that keeps nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Unbinds(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket is torch.ops.aten.unbind
            return func(*args, **(kwargs or {}))

    kw = {} if state_dtype is None else dict(state_dtype=state_dtype)
    params = _params(STACKS)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, fresh = _muon(params, offload, **kw), _muon(twin, offload, **kw)
    counts = []
    for s in range(3):
        _grads(params, s)
        _grads(twin, s)
        with Unbinds() as unbinds:
            opt.step()
        counts.append(unbinds.count)
        fresh._plans.clear()  # a new plan: new units, new staging views, nothing kept
        fresh.step()
        assert all(torch.equal(a, b) for a, b in zip(params, twin, strict=True))
    stacks = sum(p.ndim == 3 for p in params)
    assert counts == [3 * stacks, stacks, stacks]  # parameter, gradient, momentum; then one
