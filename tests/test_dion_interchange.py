"""Checkpoints move between dion's Muon and ours both ways (when dion is installed)."""

import io

import pytest
import torch

dion = pytest.importorskip(
    "dion",
    reason='needs dion, which is not on PyPI: pip install "git+https://github.com/microsoft/dion@0a059a4"',
)

from muon_offload import Muon  # noqa: E402

from reference64 import orthogonalize64_batch  # noqa: E402

# See test_vs_dion.py: dion compiles with fullgraph=True and these shapes pass its default
# recompile limit.
torch._dynamo.config.cache_size_limit = 64

SHAPES = [(32, 48), (32, 48), (48, 32), (61,)]


def _model():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _groups(params):
    return [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw")]


def _saved(state_dict):
    """Through a file, as a checkpoint travels (state_dict() returns live tensors)."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _step(params, opt, step):
    gen = torch.Generator().manual_seed(50 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


# The same float64 orthogonalizer on both sides: the two then agree to fp32 rounding
# (test_vs_dion.py measured at most 8e-7 relative), so a checkpoint carried over wrongly
# (momentum lost, step count reset, variance swapped) shows far above the bound.
KW = dict(lr=0.02, weight_decay=0.1, newton_schulz_func=orthogonalize64_batch)


@pytest.mark.parametrize("offload", [False, True])
def test_dion_checkpoint_into_ours(offload):
    params = _model()
    ref = dion.Muon(_groups(params), **KW)
    for s in range(3):
        _step(params, ref, s)
    ckpt = _saved(ref.state_dict())
    start = [p.detach().clone() for p in params]

    mine = [torch.nn.Parameter(t.clone()) for t in start]
    ours = Muon(_groups(mine), offload=offload, chunk_bytes=4096, **KW)
    ours.load_state_dict(ckpt)
    assert [g["step"] for g in ours.param_groups] == [3, 3]
    for s in range(3, 5):
        _step(params, ref, s)
        _step(mine, ours, s)
    for a, b, x0 in zip(mine, params, start, strict=True):
        rel = ((a - x0) - (b - x0)).norm() / (b - x0).norm()
        assert rel < 1e-5, (tuple(a.shape), rel.item())


def test_our_checkpoint_into_dion():
    params = _model()
    ours = Muon(_groups(params), offload=True, chunk_bytes=4096, **KW)
    for s in range(3):
        _step(params, ours, s)
    ckpt = _saved(ours.state_dict())
    start = [p.detach().clone() for p in params]

    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    ref = dion.Muon(_groups(theirs), **KW)
    ref.load_state_dict(ckpt)
    for s in range(3, 5):
        _step(params, ours, s)
        _step(theirs, ref, s)
    for a, b, x0 in zip(params, theirs, start, strict=True):
        rel = ((a - x0) - (b - x0)).norm() / (b - x0).norm()
        assert rel < 1e-5, (tuple(a.shape), rel.item())
