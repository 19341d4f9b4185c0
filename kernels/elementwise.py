"""Element-wise optimizer updates: AdamW (torch.optim.AdamW numerics) and Lion (dion's rule).

Every function updates lists of tensors in place. Index ``i`` of each list is one segment:
a parameter (or a contiguous slice of one), its gradient and its state, all with the same
number of elements. Math runs in fp32; each stored tensor is rounded once, on store.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def adamw_reference_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """AdamW with decoupled weight decay and bias correction, as ``torch.optim.AdamW``:

    m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g^2
    p = p (1 - lr wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
    """
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    step_size = lr / bias_correction1
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        g32 = g.float()
        m32 = m.float().lerp_(g32, 1.0 - beta1)
        v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1.0 - beta2)
        denom = v32.sqrt().div_(bias_correction2_sqrt).add_(eps)
        p32 = p.float().mul_(1.0 - lr * weight_decay).addcdiv_(m32, denom, value=-step_size)
        m.copy_(m32)
        v.copy_(v32)
        p.copy_(p32)


def lion_reference_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Lion as dion runs it: u = sign(lerp(m, g, 1 - beta1)); m = lerp(m, g, 1 - beta2);
    p = p (1 - lr wd) - lr u."""
    for p, g, m in zip(params, grads, exp_avgs, strict=True):
        g32 = g.float()
        m32 = m.float()
        update = torch.lerp(m32, g32, 1.0 - beta1).sign_()
        m32.lerp_(g32, 1.0 - beta2)
        p32 = p.float().mul_(1.0 - lr * weight_decay).sub_(update, alpha=lr)
        m.copy_(m32)
        p.copy_(p32)
