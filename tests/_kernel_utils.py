"""Helpers shared by the kernel tests: devices, random data, bf16-aware comparison, NaN-poisoned
outputs, the TMA-readable bf16 layouts."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Kernels run on CPU tensors only under the interpreter, and on CUDA tensors only compiled.
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not INTERPRETED, reason="CPU tensors run only under the Triton interpreter (no GPU)"
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.cuda),
]


def randn(shape, dtype, device, *, positive=False, generator=None):
    x = torch.randn(shape, dtype=torch.float32, generator=generator).to(device)
    if positive:
        x = x.abs_().add_(1e-3)
    return x.to(dtype)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each element's magnitude (as fp32)."""
    mag = x.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, exact_bf16: bool) -> None:
    """fp32: a few fp32 ulps (operation order and fused multiply-adds differ from torch's).
    bf16: within one bf16 ulp under the interpreter (it truncates instead of rounding) or
    where fp32 rounding differences can flip a rounding; identical when ``exact_bf16``.
    The 1e-7 absolute floor covers results that cancel to ~0 (lerp of nearly equal values),
    where an fp32 fused multiply-add in torch moves the result by ~1e-9."""
    assert actual.dtype == expected.dtype
    a, e = actual.float().cpu(), expected.float().cpu()
    assert not torch.isnan(a).any(), "NaN in output (an element left unwritten?)"
    if actual.dtype == torch.float32:
        torch.testing.assert_close(a, e, rtol=4e-6, atol=3e-7)
    elif exact_bf16:
        assert torch.equal(a, e), f"{(a != e).sum().item()} of {a.numel()} bf16 values differ"
    else:
        err = (a - e).abs()
        assert (err <= bf16_ulp(e) * 1.001 + 1e-7).all(), f"max error {err.max().item()}"


def tuning_as_on_a_gpu(monkeypatch, tmp_path):
    """A fresh tuner that times configs as it would on CUDA (nothing here touches a GPU)."""
    from muon_offload.kernels import _launch

    tuner = _launch.Tuner()
    monkeypatch.setattr(_launch, "interpreted", lambda: False)
    monkeypatch.setenv("MUON_OFFLOAD_AUTOTUNE", "1")
    monkeypatch.setattr(_launch.Tuner, "cache_path", staticmethod(lambda d: tmp_path / "t.json"))
    return tuner


def poisoned(shape, dtype, device):
    """NaN everywhere: an output element that a kernel leaves unwritten fails the check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_within_rounding(got, want, terms):
    """fp32: relative to the sum of the products' magnitudes (accumulation order); 16-bit:
    one ulp of the fp32 reference's rounding (fp16: 2^-10 relative) plus the same."""
    err = (got.float().cpu() - want).abs()
    if got.dtype == torch.float32:
        bound = 1e-6 * terms + 1e-30
    else:
        bound = bf16_ulp(want) * 1.001 if got.dtype == torch.bfloat16 else want.abs() * 2.0**-10
        bound = bound + 1e-5 * terms
    assert (err <= bound).all(), f"max error {err.max().item()}, {(err > bound).sum()} over"


def bf16_input(batch, m, k, transposed, seed):
    """bf16 [batch, m, k] of norm about 1 a row: rows contiguous, or a ``.mT`` view (its
    stored rows of m padded to a multiple of 8 elements, so that TMA reads it)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, k, m) if transposed else (batch, m, k)
    x = (torch.randn(shape, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
    return padded(x).mT if transposed else x


def padded(t):
    """A copy of t [B, r, c] whose rows are padded to a multiple of 8 elements (TMA)."""
    c = t.size(-1)
    buf = torch.zeros(*t.shape[:2], c + (-c % 8), dtype=t.dtype, device=t.device)
    buf[:, :, :c].copy_(t)
    return buf[:, :, :c]
