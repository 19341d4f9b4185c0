"""The torch references of quantized_elementwise.py's kernels: AdamW and Lion
(elementwise_reference.py's math) on dequantized 8-bit state, requantized after; the CPU path,
and what the kernels are tested against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .elementwise_reference import (
    AdamWHyper,
    LionHyper,
    adamw_scalars,
    cautious_decay,
    lion_scalars,
)
from .quant_maps import MAPS, _decode_ref, requantize_

if TYPE_CHECKING:  # typing_extensions (a torch dependency): Unpack on Python 3.10
    from typing_extensions import Unpack


def _lerp_ref(start: Tensor, end: Tensor, weight: float) -> Tensor:
    # torch.lerp's formula with each product rounded (as the kernels, fusion off).
    diff = end - start
    if weight < 0.5:
        return start + weight * diff
    return end - diff * (1.0 - weight)


def adamw8_reference_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    m_codes: Sequence[Tensor],
    m_scales: Sequence[Tensor],
    v_codes: Sequence[Tensor],
    v_scales: Sequence[Tensor],
    *,
    cautious_wd: bool = False,
    **hyper: Unpack[AdamWHyper],
) -> None:
    """AdamW (``adamw_reference_``'s math) on dequantized state, requantized after;
    ``cautious_wd``'s sign test reads the new first moment before it is requantized."""
    w1, beta2, omb2, eps, decay, step_size, bc2_sqrt = adamw_scalars(**hyper)
    for p, g, mc, ms, vc, vs in zip(
        params, grads, m_codes, m_scales, v_codes, v_scales, strict=True
    ):
        g32 = g.float()
        m = _lerp_ref(_decode_ref(mc, ms, MAPS["adam_m"]), g32, w1)
        v = _decode_ref(vc, vs, MAPS["adam_v"]) * beta2 + (g32 * g32) * omb2
        # A tensor divisor: torch turns division by a Python scalar into a multiplication by
        # its reciprocal (another rounding than the kernel's division).
        denom = v.sqrt() / torch.full_like(v, bc2_sqrt) + eps
        p32 = p.float()
        factor = cautious_decay(m, p32, decay) if cautious_wd else decay
        p.copy_(p32 * factor - step_size * (m / denom))
        requantize_(mc, ms, m, "adam_m")
        requantize_(vc, vs, v, "adam_v")


def lion8_reference_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    m_codes: Sequence[Tensor],
    m_scales: Sequence[Tensor],
    *,
    cautious_wd: bool = False,
    **hyper: Unpack[LionHyper],
) -> None:
    """Lion (``lion_reference_``'s math) on dequantized momentum, requantized after."""
    w1, w2, decay, lr = lion_scalars(**hyper)
    for p, g, mc, ms in zip(params, grads, m_codes, m_scales, strict=True):
        g32 = g.float()
        m = _decode_ref(mc, ms, MAPS["momentum"])
        update = _lerp_ref(m, g32, w1).sign()
        m = _lerp_ref(m, g32, w2)
        p32 = p.float()
        factor = cautious_decay(update, p32, decay) if cautious_wd else decay
        p.copy_(p32 * factor - lr * update)
        requantize_(mc, ms, m, "momentum")
