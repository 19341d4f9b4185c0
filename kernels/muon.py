"""Muon's element-wise passes around the orthogonalization, for a batch of same-shape matrices.

prep:  M = mu M + G (in place); U = mu M + G with nesterov, else M; U stored in bf16, with
       each matrix's sum of squares of the stored bf16 values (the orthogonalizer's norm).
apply: X = X (1 - lr wd) - adjusted_lr U.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def muon_prep_reference(
    momentums: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    mu: float,
    nesterov: bool,
    out: Tensor | None = None,
    sumsq: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Update momentum in place; return (U [B, m, n] bf16, sum of squares [B] fp32)."""
    batch = len(momentums)
    shape = momentums[0].shape
    if out is None:
        out = torch.empty((batch, *shape), dtype=torch.bfloat16, device=momentums[0].device)
    if sumsq is None:
        sumsq = torch.empty(batch, dtype=torch.float32, device=momentums[0].device)
    for i, (m, g) in enumerate(zip(momentums, grads, strict=True)):
        g32 = g.float()
        m32 = m.float().mul_(mu).add_(g32)
        m.copy_(m32)
        u32 = m32.mul(mu).add_(g32) if nesterov else m32
        out[i].copy_(u32)
        sumsq[i] = out[i].float().square().sum()
    return out, sumsq


def muon_apply_reference_(
    params: Sequence[Tensor],
    update: Tensor,
    *,
    lr: float,
    weight_decay: float,
    adjusted_lr: float,
) -> None:
    """X = X (1 - lr wd) - adjusted_lr U for each matrix of the batch, math in fp32."""
    decay = 1.0 - lr * weight_decay
    for i, x in enumerate(params):
        x32 = x.float().mul_(decay).sub_(update[i].float(), alpha=adjusted_lr)
        x.copy_(x32)
