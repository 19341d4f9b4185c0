"""Batched Polar Express / Newton-Schulz orthogonalization (torch bmm on every device)."""

from __future__ import annotations

import pytest
import torch
from muon_offload.kernels.orthogonalize import orthogonalize

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double().cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(32, 48), (48, 32)], ids=str)
@pytest.mark.parametrize("method", ["polar_express", "newton_schulz5"])
def test_output_is_near_orthogonal(device, shape, method):
    torch.manual_seed(0)
    u = torch.randn(3, *shape, device=device).to(torch.bfloat16)
    out = orthogonalize(u, method=method)
    assert out.shape == u.shape and out.dtype == torch.bfloat16
    s = _singular_values(out)
    # Both methods drive singular values into a band around 1 (Newton-Schulz5's is wider,
    # about [0.7, 1.2], by design of its coefficients); bf16 products add about 1%.
    assert s.min() > 0.5 and s.max() < 1.3, (s.min().item(), s.max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_given_sumsq_equals_computed(device):
    """The prep kernel's sum of squares of the stored bf16 values is what orthogonalize
    would compute itself: passing it changes nothing."""
    u = torch.randn(2, 24, 40, device=device).to(torch.bfloat16)
    sumsq = u.float().square().sum(dim=(1, 2))
    assert torch.equal(orthogonalize(u, sumsq), orthogonalize(u))


@pytest.mark.parametrize("device", DEVICES)
def test_tall_runs_on_transpose(device):
    u = torch.randn(2, 40, 24, device=device).to(torch.bfloat16)
    tall = orthogonalize(u)
    wide = orthogonalize(u.mT.contiguous())
    assert torch.equal(tall, wide.mT)
    assert tall.stride(-2) == 1  # a .mT view: muon_apply_ reads it with its strides


def test_custom_orthogonalizer_is_called():
    calls = []

    def fn(x, epsilon):
        calls.append(epsilon)
        return x

    u = torch.randn(1, 4, 4).to(torch.bfloat16)
    assert orthogonalize(u, method=fn, eps=1e-5) is u and calls == [1e-5]
