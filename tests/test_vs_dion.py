"""Against dion's Muon (microsoft/dion at 0a059a4) when it is installed."""

import pytest
import torch

dion = pytest.importorskip(
    "dion",
    reason='needs dion, which is not on PyPI: pip install "git+https://github.com/microsoft/dion@0a059a4"',
)

# dion compiles its update functions with fullgraph=True; the many shapes and settings below
# exceed Dynamo's default recompile limit of 8 (dion's own tests raise it the same way).
torch._dynamo.config.cache_size_limit = 64

from muon_offload import Muon  # noqa: E402

from reference64 import orthogonalize64_batch  # noqa: E402

SHAPES = [(64, 96), (64, 96), (96, 64), (2, 32, 48)]
VECTORS = [(97,), (1,)]

# Both orthogonalize in bf16 with the same Polar Express coefficients, but dion normalizes with
# a bf16 norm, runs tall matrices as X^T X and rounds each term of the polynomial; we use an
# fp32 norm, the transpose and fused baddbmm. Measured (CPU, torch 2.13, 3 steps, the cases
# below): relative RMS difference of the total change of each matrix 1.1% to 2.5% (rms_norm
# the larger), each side being 0.8% to 1.9% from float64 (test_math.py); adamw and lion vectors
# within 3e-7. 4% for matrices sits under what the nearest wrong variant gives (Newton-Schulz
# coefficients in place of Polar Express: 6.4% from float64).
MATRIX_RTOL = 4e-2
VECTOR_RTOL = 1e-5


def _run(cls, init, group_kwargs, steps=3, **kwargs):
    mats = [torch.nn.Parameter(t.clone()) for t in init[: len(SHAPES)]]
    vecs = [torch.nn.Parameter(t.clone()) for t in init[len(SHAPES) :]]
    groups = [dict(params=mats), dict(params=vecs, **group_kwargs)]
    opt = cls(groups, **kwargs)
    for s in range(steps):
        gen = torch.Generator().manual_seed(100 + s)
        for p in mats + vecs:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return mats, vecs, opt


@pytest.mark.parametrize("algorithm", ["adamw", "lion"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm"])
def test_matches_dion(algorithm, nesterov, adjust_lr):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES + VECTORS]
    kwargs = dict(lr=0.02, mu=0.9, weight_decay=0.1, nesterov=nesterov, adjust_lr=adjust_lr)
    ours = _run(Muon, init, dict(algorithm=algorithm), **kwargs)
    ref = _run(dion.Muon, init, dict(algorithm=algorithm), **kwargs)
    for a, b, x0 in zip(ours[0], ref[0], init, strict=False):
        rel = ((a - x0) - (b - x0)).norm() / (b - x0).norm()
        assert rel < MATRIX_RTOL
    for a, b, x0 in zip(ours[1], ref[1], init[len(SHAPES) :], strict=True):
        rel = ((a - x0) - (b - x0)).norm() / (b - x0).norm()
        assert rel < VECTOR_RTOL
    assert [g["step"] for g in ours[2].param_groups] == [g["step"] for g in ref[2].param_groups]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm", None])
def test_matches_dion_with_a_float64_orthogonalizer(nesterov, adjust_lr):
    """Both given the same float64 orthogonalizer, everything else (momentum, nesterov, the
    bf16 rounding of U, lr adjustment, weight decay, adamw and lion) must agree to fp32
    rounding: measured at most 8e-7 relative on the updates (CPU, torch 2.13)."""
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in SHAPES + VECTORS]
    kwargs = dict(
        lr=0.02,
        mu=0.9,
        weight_decay=0.1,
        nesterov=nesterov,
        adjust_lr=adjust_lr,
        newton_schulz_func=orthogonalize64_batch,
    )
    ours = _run(Muon, init, dict(algorithm="adamw"), **kwargs)
    ref = _run(dion.Muon, init, dict(algorithm="adamw"), **kwargs)
    for a, b, x0 in zip(ours[0] + ours[1], ref[0] + ref[1], init, strict=True):
        rel = ((a - x0) - (b - x0)).norm() / (b - x0).norm()
        assert rel < 1e-5, (tuple(a.shape), rel.item())
