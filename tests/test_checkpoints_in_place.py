"""A checkpoint loaded in place into the live state_dict(), without load_state_dict, as
torchao's FSDP2 tests resume (``dcp.load(opt.state_dict())``) and as torch's optimizers allow:
the state tensors and each parameter's step count are the live ones, so the resumed run equals
the uninterrupted one bitwise. Dense and 8-bit state, resident and offloaded, on the CPU with
``torch.distributed.checkpoint`` in one process."""

import pytest
import torch

from muon_offload import AdamW, Muon

dcp = pytest.importorskip("torch.distributed.checkpoint")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# AdamW matrices of 8-bit size (>= 4,096 elements), a small vector; a Muon matrix.
SHAPES = [(64, 80), (70, 64), (37,), (24, 40)]
CONFIGS = [
    dict(),
    dict(offload=True),
    dict(state_dtype=torch.int8),
    dict(offload=True, state_dtype=torch.int8),
]


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in SHAPES]


def _adamw(params, **kw):
    return AdamW(params[:3], lr=1e-2, weight_decay=0.1, **kw)


def _muon(params, **kw):
    groups = [dict(params=params[3:]), dict(params=params[:3], algorithm="adamw")]
    return Muon(groups, lr=0.02, weight_decay=0.1, **kw)


def _steps(params, opt, start, count, skip=()):
    """Seeded gradients; those in ``skip`` get none at the first step (unequal counts)."""
    for s in range(start, start + count):
        gen = torch.Generator().manual_seed(100 + s)
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen)
            p.grad = None if (s == start and i in skip) else g
        opt.step()


@pytest.mark.parametrize("make", [_adamw, _muon], ids=["adamw", "muon"])
@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
def test_in_place_load_resumes_bitwise(make, kw, stepped, tmp_path):
    params = _params()
    opt = make(params, **kw)
    _steps(params, opt, 0, 3, skip={0, 2})  # counts 2, 3, 2
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path))

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = make(resumed, **kw)
    if stepped:  # state and counts of its own, all to be overwritten
        _steps(resumed, opt2, 50, 2)
        for p, q in zip(resumed, params, strict=True):
            p.data.copy_(q)
    target = {"optim": opt2.state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path))  # in place; no load_state_dict
    _steps(params, opt, 3, 2)
    _steps(resumed, opt2, 3, 2)
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)


def test_counts_in_the_state_dict_are_the_live_ones():
    params = _params()
    opt = _adamw(params)
    sd = opt.state_dict()
    _steps(params, opt, 0, 2, skip={1})
    assert [sd["state"][i]["step"].item() for i in range(3)] == [2, 1, 2]
    sd["state"][1]["step"].fill_(7)
    assert opt.state_dict()["state"][1]["step"].item() == 7
    assert opt.state_dict()["state"][0]["step"].item() == 2


def test_counts_loaded_into_a_state_dict_from_before_added_groups_are_refused():
    """Adding parameters may grow the counts' tensor: a state dict taken before then holds
    views the engine no longer reads, and a load into them raises at the next step instead
    of being lost."""
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(64)]
    opt = AdamW(params, lr=1e-2)
    old = opt.state_dict()
    opt.add_param_group(dict(params=[torch.nn.Parameter(torch.randn(3))]))
    for p in opt.param_groups[0]["params"] + opt.param_groups[1]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()  # nothing written into the old views: fine
    old["state"][0]["step"].fill_(5)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="take a new state_dict"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    opt.load_state_dict(opt.state_dict())  # load_state_dict sets every count afresh
    opt.step()
