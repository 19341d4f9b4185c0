"""The torch references of elementwise.py's kernels, AdamW (torch.optim.AdamW numerics) and
Lion (dion's rule): the CPU path, and what the kernels are tested against. Same segment
lists as the kernels; math in fp32, each stored tensor rounded once."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import Tensor

if TYPE_CHECKING:  # typing_extensions (a torch dependency): Unpack on Python 3.10
    from typing_extensions import Unpack


def cautious_decay(update: Tensor, p32: Tensor, decay: float) -> Tensor:
    """dion's cautious weight decay (``cautious_wd``, arXiv 2510.12402): the factor
    ``decay`` = 1 - lr wd where the update and the parameter before the step agree in sign
    (their product >= 0, zero included), 1 elsewhere. The update's sign is the direction's:
    AdamW's new first moment (its denominator and bias correction are positive), Lion's sign,
    Muon's orthogonalized matrix."""
    return torch.where(update * p32 >= 0, decay, 1.0)


class AdamWHyper(TypedDict):
    """AdamW's hyper-parameters, the keywords its launchers and references take (dense and
    8-bit): ``adamw_scalars``' arguments."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int


class LionHyper(TypedDict):
    """Lion's, likewise: ``lion_scalars``' arguments."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float


def adamw_scalars(lr, beta1, beta2, eps, weight_decay, step) -> tuple[float, ...]:
    """AdamW's scalars, shared by the references and the kernels (dense and 8-bit): 1 - beta1,
    beta2, 1 - beta2, eps, 1 - lr wd, lr / bc1, sqrt(bc2)."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    decay, step_size = 1.0 - lr * weight_decay, lr / (1.0 - beta1**step)
    return (1.0 - beta1, beta2, 1.0 - beta2, eps, decay, step_size, math.sqrt(1.0 - beta2**step))


def lion_scalars(lr, beta1, beta2, weight_decay) -> tuple[float, ...]:
    """Lion's scalars, shared by the references and the kernels (dense and 8-bit): 1 - beta1,
    1 - beta2, 1 - lr wd, lr."""
    return (1.0 - beta1, 1.0 - beta2, 1.0 - lr * weight_decay, lr)


def adamw_reference_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    cautious_wd: bool = False,
    **hyper: Unpack[AdamWHyper],
) -> None:
    """AdamW with decoupled weight decay and bias correction, as ``torch.optim.AdamW``:

    m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g^2
    p = p (1 - lr wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)

    ``cautious_wd``: the decay only where m (new) and p (old) agree in sign (``cautious_decay``).
    """
    w1, beta2, omb2, eps, decay, step_size, bc2_sqrt = adamw_scalars(**hyper)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        g32 = g.float()
        m32 = m.float().lerp_(g32, w1)
        v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=omb2)
        denom = v32.sqrt().div_(bc2_sqrt).add_(eps)
        p32 = p.float()
        factor = cautious_decay(m32, p32, decay) if cautious_wd else decay
        p32 = p32.mul_(factor).addcdiv_(m32, denom, value=-step_size)
        m.copy_(m32)
        v.copy_(v32)
        p.copy_(p32)


def lion_reference_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    *,
    cautious_wd: bool = False,
    **hyper: Unpack[LionHyper],
) -> None:
    """Lion as dion runs it: u = sign(lerp(m, g, 1 - beta1)); m = lerp(m, g, 1 - beta2);
    p = p (1 - lr wd) - lr u; ``cautious_wd``: the decay only where u and p agree in sign."""
    w1, w2, decay, lr = lion_scalars(**hyper)
    for p, g, m in zip(params, grads, exp_avgs, strict=True):
        g32 = g.float()
        m32 = m.float()
        update = torch.lerp(m32, g32, w1).sign_()
        m32.lerp_(g32, w2)
        p32 = p.float()
        factor = cautious_decay(update, p32, decay) if cautious_wd else decay
        p32 = p32.mul_(factor).sub_(update, alpha=lr)
        m.copy_(m32)
        p.copy_(p32)
