"""Fused Muon prep and apply kernels against their torch references."""

from __future__ import annotations

import pytest
import torch
from _kernel_utils import DEVICES, INTERPRETED, assert_close, randn
from muon_offload.kernels.muon import (
    muon_apply_,
    muon_apply_reference_,
    muon_prep,
    muon_prep_reference,
)

F32, BF16 = torch.float32, torch.bfloat16
# 1 element, odd shapes that are no multiple of the tiles, one larger than a chunk.
SHAPES = [(1, 1), (3, 5), (33, 65), (40, 70)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16), (F32, BF16)], ids=str)
@pytest.mark.parametrize("nesterov", [True, False])
def test_prep_matches_reference(device, shape, dtypes, nesterov):
    m_dtype, g_dtype = dtypes
    batch = 3
    momentums = [randn(shape, m_dtype, device) for _ in range(batch)]
    grads = [randn(shape, g_dtype, device) for _ in range(batch)]
    ref_m = [m.clone() for m in momentums]
    out = torch.full((batch, *shape), float("nan"), dtype=BF16, device=device)
    sumsq = torch.full((batch,), float("nan"), device=device)
    got_out, got_sumsq = muon_prep(
        momentums, grads, mu=0.95, nesterov=nesterov, out=out, sumsq=sumsq
    )
    assert got_out is out and got_sumsq is sumsq
    ref_out, ref_sumsq = muon_prep_reference(ref_m, grads, mu=0.95, nesterov=nesterov)
    # The GPU rounds U to nearest even like the reference (fp fusion is off in the kernel);
    # the interpreter truncates.
    for a, e in zip(momentums, ref_m, strict=True):
        assert_close(a, e, exact_bf16=not INTERPRETED)
    assert_close(out, ref_out, exact_bf16=not INTERPRETED)
    # sumsq sums the values the kernel stored; only the order of the fp32 sum differs.
    own = out.float().square().sum(dim=(1, 2))
    torch.testing.assert_close(sumsq, own, rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_prep_views_into_flat_buffer(device):
    """Momentum matrices as slices of one flat staging buffer at an unaligned offset."""
    shape, batch = (7, 9), 2
    flat = randn(3 + batch * 63, F32, device)
    momentums = [flat[3 + i * 63 : 3 + (i + 1) * 63].view(shape) for i in range(batch)]
    grads = [randn(shape, F32, device) for _ in range(batch)]
    ref_m = [m.clone() for m in momentums]
    head = flat[:3].clone()
    out, _ = muon_prep(momentums, grads, mu=0.9, nesterov=True)
    ref_out, _ = muon_prep_reference(ref_m, grads, mu=0.9, nesterov=True)
    for a, e in zip(momentums, ref_m, strict=True):
        assert_close(a, e, exact_bf16=True)
    assert_close(out, ref_out, exact_bf16=not INTERPRETED)
    assert torch.equal(flat[:3], head)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (70, 33)], ids=str)
@pytest.mark.parametrize("x_dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("u_dtype", [BF16, F32], ids=str)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("cautious_wd", [False, True], ids=["wd", "cautious_wd"])
def test_apply_matches_reference(device, shape, x_dtype, u_dtype, transposed, cautious_wd):
    batch = 3
    params = [randn(shape, x_dtype, device) for _ in range(batch)]
    ref = [x.clone() for x in params]
    if transposed:  # what orthogonalize returns for tall matrices: a .mT view
        update = randn((batch, shape[1], shape[0]), u_dtype, device).mT
    else:
        update = randn((batch, *shape), u_dtype, device)
    hyper = dict(lr=0.02, weight_decay=0.1, adjusted_lr=0.02 * 0.2 * max(shape) ** 0.5)
    hyper["cautious_wd"] = cautious_wd
    muon_apply_(params, update, **hyper)
    muon_apply_reference_(ref, update, **hyper)
    for a, e in zip(params, ref, strict=True):
        assert_close(a, e, exact_bf16=False)


@pytest.mark.parametrize("device", DEVICES)
def test_apply_flat_params(device):
    """Parameters given as flat slices of a buffer (m*n elements each, read row-major)."""
    batch, shape = 2, (5, 6)
    flat = randn(batch * 30 + 1, F32, device)
    params = [flat[1 + i * 30 : 1 + (i + 1) * 30] for i in range(batch)]
    ref = [x.clone().view(shape) for x in params]
    update = randn((batch, *shape), BF16, device)
    muon_apply_(params, update, lr=0.1, weight_decay=0.01, adjusted_lr=0.05)
    muon_apply_reference_(ref, update, lr=0.1, weight_decay=0.01, adjusted_lr=0.05)
    for a, e in zip(params, ref, strict=True):
        assert_close(a.view(shape), e, exact_bf16=False)


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_mismatched_batch(device):
    m = [randn((4, 4), F32, device)]
    with pytest.raises(ValueError):
        muon_prep(m, [randn((4, 5), F32, device)], mu=0.9, nesterov=False)
    with pytest.raises(ValueError):
        muon_apply_(m, randn((2, 4, 4), BF16, device), lr=0.1, weight_decay=0, adjusted_lr=0.1)


@pytest.mark.parametrize(
    "spoil, message",
    [
        ("grad shape", r"grads\[3\] is torch.float32 \(2, 8\), expected torch.float32 \(4, 4\)"),
        ("momentum dtype", r"momentums\[3\] is torch.bfloat16 \(4, 4\), expected torch.float32"),
        ("strided grad", "grads: every tensor must be contiguous"),
        ("param size", r"params\[3\]: 20 elements of torch.float32, expected 16"),
        (
            "param dtype",
            r"params\[3\]: 16 elements of torch.bfloat16, expected 16 of torch.float32",
        ),
    ],
)
def test_a_bad_matrix_in_a_batch_is_named(spoil, message):
    """The checks of a batch find its one bad matrix (here the fourth of six) and name it,
    before anything is written."""
    m = [torch.randn(4, 4) for _ in range(6)]
    g = [torch.randn(4, 4) for _ in range(6)]
    p = [torch.randn(4, 4) for _ in range(6)]
    if spoil == "grad shape":
        g[3] = torch.randn(2, 8)  # as many elements, another shape
    elif spoil == "momentum dtype":
        m[3] = m[3].to(BF16)
    elif spoil == "strided grad":
        g[3] = torch.randn(4, 8)[:, ::2]
    elif spoil == "param size":
        p[3] = torch.randn(4, 5)
    elif spoil == "param dtype":
        p[3] = p[3].to(BF16)
    before = [t.clone() for t in (*m, *p)]
    with pytest.raises(ValueError, match=message):
        if spoil.startswith("param"):
            muon_apply_(p, torch.randn(6, 4, 4).to(BF16), lr=0.1, weight_decay=0, adjusted_lr=0.1)
        else:
            muon_prep(m, g, mu=0.9, nesterov=False)
    assert all(torch.equal(a, b) for a, b in zip((*m, *p), before, strict=True))


@pytest.mark.cuda
def test_prep_autotune_applies_update_once(tmp_path, monkeypatch):
    """With an empty tuning cache every config is timed (on scratch copies): momentum is
    still updated exactly once, bit for bit as the reference."""
    import muon_offload.kernels.muon as mk
    from muon_offload.kernels import _launch

    monkeypatch.setenv("MUON_OFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MUON_OFFLOAD_AUTOTUNE", "1")
    monkeypatch.setattr(mk, "TUNER", _launch.Tuner())
    shape, batch = (256, 768), 4
    momentums = [randn(shape, F32, "cuda") for _ in range(batch)]
    grads = [randn(shape, F32, "cuda") for _ in range(batch)]
    ref_m = [m.clone() for m in momentums]
    out, _ = muon_prep(momentums, grads, mu=0.95, nesterov=True)
    ref_out, _ = muon_prep_reference(ref_m, grads, mu=0.95, nesterov=True)
    for a, e in zip(momentums, ref_m, strict=True):
        assert torch.equal(a, e)
    assert torch.equal(out, ref_out)
    params = [randn(shape, F32, "cuda") for _ in range(batch)]
    ref_p = [x.clone() for x in params]
    muon_apply_(params, out, lr=0.02, weight_decay=0.1, adjusted_lr=0.01)
    muon_apply_reference_(ref_p, out, lr=0.02, weight_decay=0.1, adjusted_lr=0.01)
    for a, e in zip(params, ref_p, strict=True):
        assert_close(a, e, exact_bf16=False)
    assert "muon_prep|" in next(tmp_path.glob("tune-*.json")).read_text()
