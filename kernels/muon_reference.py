"""The plain-torch Muon prep and apply that ``muon.py``'s kernels are tested against (the CPU
path runs them too), and what both share: the prep's outputs and the apply's scalars."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import Tensor

from .elementwise_reference import cautious_decay

if TYPE_CHECKING:  # typing_extensions (a torch dependency): Unpack on Python 3.10
    from typing_extensions import Required, Unpack


def new_outputs(batch: int, shape, device, out: Tensor | None, sumsq: Tensor | None):
    """A prep's outputs where not given (kernels and references, dense and 8-bit): ``out``
    bf16 [batch, *shape] and ``sumsq`` fp32 [batch]."""
    if out is None:
        out = torch.empty((batch, *shape), dtype=torch.bfloat16, device=device)
    if sumsq is None:
        sumsq = torch.empty(batch, dtype=torch.float32, device=device)
    return out, sumsq


class ApplyHyper(TypedDict):
    """The apply's hyper-parameters, the keywords of ``muon_apply_`` and its reference:
    ``apply_scalars``' arguments."""

    lr: float
    weight_decay: float
    adjusted_lr: float


class PrepKeywords(TypedDict, total=False):
    """``muon_prep_reference``'s keywords, which the 8-bit reference passes on unchanged."""

    mu: Required[float]
    nesterov: Required[bool]
    out: Tensor | None
    sumsq: Tensor | None


def apply_scalars(lr: float, weight_decay: float, adjusted_lr: float) -> tuple[float, float]:
    """The apply kernel's runtime scalars: 1 - lr wd, adjusted_lr."""
    return 1.0 - lr * weight_decay, float(adjusted_lr)


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
    out, sumsq = new_outputs(batch, momentums[0].shape, momentums[0].device, out, sumsq)
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
    cautious_wd: bool = False,
    **hyper: Unpack[ApplyHyper],
) -> None:
    """X = X (1 - lr wd) - adjusted_lr U for each matrix of the batch, math in fp32.
    ``cautious_wd`` (dion's): the decay only where U and X (before the step) agree in sign."""
    decay, adjusted_lr = apply_scalars(**hyper)
    for i, x in enumerate(params):
        u32, x32 = update[i].float(), x.float()
        factor = cautious_decay(u32, x32, decay) if cautious_wd else decay
        x32 = x32.mul_(factor).sub_(u32, alpha=adjusted_lr)
        x.copy_(x32)
