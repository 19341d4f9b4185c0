"""The sum of squares in the order ``kernels/sumsq.py`` fixes: the kernel against a plain
re-enactment of that order (bit for bit), the prep kernel's sums against it, and both near
float64."""

from __future__ import annotations

import pytest
import torch
from _kernel_utils import DEVICES
from muon_offload.kernels.muon import muon_prep
from muon_offload.kernels.sumsq import (
    MAX_ROW_LANES,
    SUMSQ_BLOCK,
    SUMSQ_CHUNK,
    sum_squares,
)


def _pairwise(x: torch.Tensor) -> torch.Tensor:
    while x.numel() > 1:
        pairs = x.view(-1, 2)
        x = pairs[:, 0] + pairs[:, 1]  # fp32 adds, one rounding each
    return x[0]


def _lanes(values: torch.Tensor, lanes: int) -> torch.Tensor:
    """Lane l adds values l, l + lanes, ... in turn (zeros past the end)."""
    rows = -(-values.numel() // lanes)
    padded = torch.zeros(rows * lanes, dtype=torch.float32)
    padded[: values.numel()] = values
    acc = torch.zeros(lanes, dtype=torch.float32)
    for row in padded.view(rows, lanes):
        acc = acc + row
    return acc


def documented_order(flat: torch.Tensor) -> torch.Tensor:
    """The documented order, written out with fp32 tensors on the CPU."""
    sq = flat.float().cpu().square()
    groups = [sq[s : s + SUMSQ_CHUNK] for s in range(0, sq.numel(), SUMSQ_CHUNK)]
    partials = torch.stack([_pairwise(_lanes(g, SUMSQ_BLOCK)) for g in groups])
    lanes = min(MAX_ROW_LANES, 1 << max(len(groups) - 1, 0).bit_length())
    return _pairwise(_lanes(partials, lanes))


# One group with a short tail; exactly one group; three groups, the last short.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (128, 256), (190, 500)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_adds_in_the_documented_order(device, shape, dtype):
    gen = torch.Generator().manual_seed(shape[0])
    u = (torch.randn((3, *shape), generator=gen) * 4).to(dtype).to(device)
    got = sum_squares(u)
    for i in range(3):
        want = documented_order(u[i].reshape(-1))
        assert torch.equal(got[i].cpu(), want), (got[i].item(), want.item())
    f64 = u.double().square().sum(dim=(1, 2)).cpu()
    torch.testing.assert_close(got.double().cpu(), f64, rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_view_sums_its_storage(device):
    u = torch.randn(2, 70, 300).to(torch.bfloat16).to(device)
    assert torch.equal(sum_squares(u.mT), sum_squares(u))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prep_sums_as_sum_squares(device, m_dtype):
    """Bit for bit: a batch that reaches orthogonalize without prep's sums (a sharded matrix
    gathered whole) is normalized exactly as one that comes from prep."""
    gen = torch.Generator().manual_seed(9)
    shape = (190, 500)  # three groups, the last one short
    momentums = [torch.randn(shape, generator=gen).to(m_dtype).to(device) for _ in range(2)]
    grads = [torch.randn(shape, generator=gen).to(device) for _ in range(2)]
    out, sumsq = muon_prep(momentums, grads, mu=0.95, nesterov=True)
    assert torch.equal(sumsq, sum_squares(out))
