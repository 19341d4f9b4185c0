"""Helpers shared by the kernel tests: devices, random data, bf16-aware comparison."""

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
