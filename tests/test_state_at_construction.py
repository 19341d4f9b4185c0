"""State exists from construction, as dion's Muon makes it (0a059a4, megabatch_base.py): a
state_dict() before any step holds every key dion's would, groups added later get theirs, and
the steps after are bitwise those of state made at the first step. Parameters moved after
construction take their state along. The live state_dict() restores everything when loaded
in place (``dcp.load(opt.state_dict())``, no load_state_dict), as torch's optimizers do."""

import copy

import pytest
import torch

from muon_offload import AdamW, Muon

# One Muon matrix, a 3-D stack, AdamW matrices of 8-bit size (>= 4,096) and a small vector.
SHAPES = [(24, 40), (2, 16, 24), (64, 80), (70, 64), (37,)]
MODES = [dict(), dict(offload=True), dict(offload=True, chunk_bytes=4096)]
STATES = [None, torch.int8]


def _params(seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device) * 0.1) for s in SHAPES]


def _groups(params):
    return [dict(params=params[:2]), dict(params=params[2:], algorithm="adamw")]


def _muon(params, **kw):
    return Muon(_groups(params), lr=0.02, weight_decay=0.1, **kw)


def _steps(params, opt, start, count, skip=()):
    """Steps with seeded gradients; parameters in ``skip`` get none at the first of them (so
    the parameters' step counts differ)."""
    for s in range(start, start + count):
        gen = torch.Generator().manual_seed(100 + s)
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen)
            p.grad = None if (s == start and i in skip) else g.to(p.device)
        opt.step()


def _keys(state_dict):
    return {i: set(v) for i, v in state_dict["state"].items()}


@pytest.mark.parametrize("kw", MODES[:2])
@pytest.mark.parametrize("state_dtype", STATES)
def test_state_dict_before_any_step_holds_every_key(kw, state_dtype):
    params = _params()
    opt = _muon(params, state_dtype=state_dtype, **kw)
    sd = opt.state_dict()
    assert set(sd["state"]) == set(range(len(SHAPES)))
    for i, values in sd["state"].items():
        assert all(not torch.is_tensor(t) or not t.any() for t in values.values()), i
    names = ("momentum", "variance")
    for i, values in sd["state"].items():
        wanted = {"momentum"} if i < 2 else set(names)
        if state_dtype is not None and torch.Size(SHAPES[i]).numel() >= 4096:
            wanted = {f"{k}_{part}" for k in wanted for part in ("codes", "scales")}
        assert set(values) == wanted | ({"step_dev"} if i >= 2 else set()), i
        if i >= 2:
            assert values["step_dev"].item() == 0


def test_key_sets_match_dions_before_any_step():
    dion = pytest.importorskip("dion")
    params = _params()
    ours = _muon(params)
    theirs = dion.Muon(_groups([torch.nn.Parameter(p.detach().clone()) for p in params]))
    assert _keys(ours.state_dict()) == _keys(theirs.state_dict())
    # A group added later gets its state at once, in both.
    extra = torch.nn.Parameter(torch.randn(9))
    ours.add_param_group(dict(params=[extra], algorithm="adamw"))
    theirs.add_param_group(
        dict(params=[torch.nn.Parameter(extra.detach().clone())], algorithm="adamw")
    )
    assert _keys(ours.state_dict()) == _keys(theirs.state_dict())
    assert len(ours.state_dict()["state"]) == len(SHAPES) + 1


@pytest.mark.parametrize("kw", MODES)
@pytest.mark.parametrize("state_dtype", STATES)
def test_steps_equal_state_made_at_the_first_step(kw, state_dtype):
    """State made at construction steps bitwise as state made by the first step (what a
    dropped state, or the optimizers before, do), with unequal step counts."""
    a, b = _params(), _params()
    eager = _muon(a, state_dtype=state_dtype, **kw)
    lazy = _muon(b, state_dtype=state_dtype, **kw)
    for p in b:
        del lazy.state[p]
    assert not lazy.state_dict()["state"]
    _steps(a, eager, 0, 3, skip={1, 3})
    _steps(b, lazy, 0, 3, skip={1, 3})
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for name, t in eager.state[x].items():
            assert torch.equal(t, lazy.state[y][name]), (i, name)


@pytest.mark.parametrize("kw", MODES[:2])
def test_a_group_added_later_steps_as_one_given_at_construction(kw):
    a, b = _params(), _params()
    whole = AdamW(a, lr=1e-2, **kw)
    split = AdamW(b[:3], lr=1e-2, **kw)
    split.add_param_group(dict(params=b[3:]))
    assert len(split.state) == len(SHAPES)
    _steps(a, whole, 0, 3, skip={0})
    _steps(b, split, 0, 3, skip={0})
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("kw", MODES[:2])
@pytest.mark.parametrize("state_dtype", STATES)
def test_parameters_moved_after_construction_take_their_state(kw, state_dtype):
    """Built on the meta device, the parameters then materialized keeping their identity (as
    ``module.to_empty`` does with ``torch.__future__.set_swap_module_params_on_conversion``):
    the first step creates the state for their device and runs as an optimizer built on them,
    step counts and a load made before the move kept."""
    ref_params, moved = _params(), _params(device="meta")
    ref = _muon(ref_params, state_dtype=state_dtype, **kw)
    opt = _muon(moved, state_dtype=state_dtype, **kw)
    _steps(ref_params, ref, 0, 2, skip={2})
    saved = copy.deepcopy(ref.state_dict())
    opt.load_state_dict(saved)  # into the meta state: the values are lost, the counts kept
    for p, q in zip(moved, ref_params, strict=True):
        torch.utils.swap_tensors(p, torch.nn.Parameter(q.detach().clone()))
    opt.load_state_dict(saved)  # state still where it was made: written as it is
    _steps(ref_params, ref, 2, 3)
    _steps(moved, opt, 2, 3)
    for x, y in zip(ref_params, moved, strict=True):
        assert torch.equal(x, y)
    assert all(t.device.type == "cpu" for v in opt.state.values() for t in v.values())


@pytest.mark.cuda
@pytest.mark.parametrize("kw", MODES[:2])
def test_state_follows_the_model_to_the_gpu(kw):
    """An optimizer built on the CPU, the model moved to the GPU after (``module.to`` keeps
    the parameters): the state moves with it (pinned host slabs when offloaded), and the
    steps equal those of an optimizer built on the GPU."""
    on_gpu = _params(device="cuda")
    moved = _params()
    ref = _muon(on_gpu, **kw)
    opt = _muon(moved, **kw)
    for p in moved:
        p.data = p.data.cuda()
    _steps(on_gpu, ref, 0, 3, skip={3})
    _steps(moved, opt, 0, 3, skip={3})
    for x, y in zip(on_gpu, moved, strict=True):
        assert torch.equal(x, y)
    where = {t.device.type for v in opt.state.values() for t in v.values()}
    assert where == ({"cpu"} if kw.get("offload") else {"cuda"})
    if kw.get("offload"):
        assert all(t.is_pinned() for v in opt.state.values() for t in v.values())
