"""The orthogonalizer's normalization kernel against its torch expression: odd sizes, batches,
transposed views, NaN-poisoned outputs (an unwritten element fails)."""

from __future__ import annotations

import pytest
import torch
from _kernel_utils import DEVICES, INTERPRETED, assert_close, bf16_ulp
from muon_offload.kernels import normalize as nz


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch, m, n, tall",
    [(1, 1, 1, False), (3, 37, 53, False), (2, 53, 37, True), (5, 8, 300, False)],
)
def test_matches_reference(device, batch, m, n, tall, monkeypatch):
    gen = torch.Generator().manual_seed(batch * 1000 + m)
    base = (
        torch.randn(batch, n, m, generator=gen) if tall else torch.randn(batch, m, n, generator=gen)
    )
    u = (base * 3).to(torch.bfloat16).to(device)
    u = u.mT if tall else u
    sumsq = u.float().square().sum(dim=(1, 2))
    poisoned = torch.full((batch, m * n), float("nan"), dtype=torch.bfloat16, device=device)
    monkeypatch.setattr(nz.torch, "empty_like", lambda t, **kw: poisoned)
    out = nz.normalize(u, sumsq, norm_scale=1.02, eps=1e-8)
    monkeypatch.undo()
    assert out.untyped_storage().data_ptr() == poisoned.untyped_storage().data_ptr()
    assert out.shape == u.shape and out.stride() == u.stride()
    expected = nz.normalize_reference(u, sumsq, norm_scale=1.02, eps=1e-8)
    if INTERPRETED:
        # The interpreter truncates fp32 -> bf16 instead of rounding, twice here (the scale,
        # then the product): up to two bf16 ulps. The GPU rounds like torch: identical.
        assert not torch.isnan(out).any(), "an element left unwritten"
        err = (out.float() - expected.float()).abs()
        assert (err <= 2 * bf16_ulp(expected) * 1.001).all(), err.max().item()
    else:
        assert_close(out, expected, exact_bf16=True)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_batch_falls_back_to_reference(device):
    u = torch.randn(2, 16, 24, device=device).to(torch.bfloat16)[:, ::2]
    sumsq = u.float().square().sum(dim=(1, 2))
    out = nz.normalize(u, sumsq, norm_scale=1.0, eps=1e-7)
    assert torch.equal(out, nz.normalize_reference(u, sumsq, norm_scale=1.0, eps=1e-7))


def test_rejects_bad_input():
    u = torch.randn(2, 4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32 batch"):
        nz.normalize(u.double(), torch.ones(2), norm_scale=1.0, eps=0.0)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32 batch"):
        nz.normalize(u, torch.ones(2), norm_scale=1.0, eps=0.0, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="sumsq"):
        nz.normalize(u, torch.ones(3), norm_scale=1.0, eps=0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tall", [False, True])
def test_fp32_scale_into_fp16(device, in_dtype, tall):
    """Gram Newton-Schulz's start: the scale kept in fp32, one rounding into fp16. fp16
    conversions round to nearest under the interpreter too (only bf16 ones truncate), so
    the kernel equals the torch expression bit for bit."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(3, 45, 37, generator=gen) * 5
    u = base.to(in_dtype).to(device)
    u = u.mT if tall else u
    sumsq = u.float().square().sum(dim=(1, 2))
    kw = dict(norm_scale=1.0, eps=1e-7, out_dtype=torch.float16, round_scale=False)
    out = nz.normalize(u, sumsq, **kw)
    assert out.dtype == torch.float16 and out.stride() == u.stride()
    assert torch.equal(out, nz.normalize_reference(u, sumsq, **kw))
