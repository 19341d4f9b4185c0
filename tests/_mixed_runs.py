"""The optimizer runs that the offload and scheduler tests compare bit for bit: Muon, AdamW and
Lion groups over copies of the same random parameters, a few steps of fresh random gradients."""

from __future__ import annotations

import torch

from muon_offload import Muon


def mixed_run(init, muon: int, adamw: int, seed: int, *, steps: int = 4, scheduler=None, **kwargs):
    """``init[:muon]`` as Muon parameters, the next ``adamw`` as AdamW, the rest as Lion;
    ``steps`` steps with gradients seeded ``seed``, ``seed + 1``, ...; returns (params, opt).
    ``scheduler``: put in place of the optimizer's before the first step."""
    params = [torch.nn.Parameter(t.clone()) for t in init]
    groups = [
        dict(params=params[:muon]),
        dict(params=params[muon : muon + adamw], algorithm="adamw"),
        dict(params=params[muon + adamw :], algorithm="lion"),
    ]
    opt = Muon(groups, lr=0.02, weight_decay=0.05, **kwargs)
    if scheduler is not None:
        opt._streams.scheduler = scheduler
    for s in range(steps):
        gen = torch.Generator().manual_seed(seed + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def assert_bitwise(a, b) -> None:
    """Two (params, opt) runs: the same weights, state tensors and step counts, bit for bit;
    offloaded state (host) compares with resident state (device) on the host."""
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb, strict=True):
        assert torch.equal(x, y)
        for key in oa.state[x]:
            assert torch.equal(oa.state[x][key].cpu(), ob.state[y][key].cpu()), key
    assert [g["step"] for g in oa.param_groups] == [g["step"] for g in ob.param_groups]


def state_copy(opt, params) -> list[dict]:
    """Each parameter's state, cloned (a snapshot to compare with a later one)."""
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


def same_tensors(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def same_state(a, b) -> bool:
    """Two ``state_copy`` snapshots: the same keys, bit for bit."""
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )
