"""Orthogonalization of a batch of bf16 matrices: Polar Express and quintic Newton-Schulz.

Input: U [B, m, n] bf16 and, when the caller has it, each matrix's sum of squares
[B] fp32 (the Muon prep kernel produces it, so the normalization needs no extra pass).
Tall matrices (m > n) run on their transpose, so the Gram matrix X X^T is the small one.
Each iteration is X <- a X + (b A + c A A) X with A = X X^T, as two ``baddbmm`` calls
per product so every bf16 intermediate is rounded once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Polar Express (Amsel et al., arXiv:2505.16932), num_iters=5, safety factor 2e-2, cushion 2:
# the coefficients dion ships. They assume the input was divided by ``norm * 1.02 + eps``.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_NORM_SCALE = 1.02

# Classic quintic Newton-Schulz (dion's zeropower_via_newtonschulz5); input divided by
# ``norm + eps``.
NEWTON_SCHULZ5_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

ORTHOGONALIZERS = {
    "polar_express": (POLAR_EXPRESS_COEFFS, POLAR_EXPRESS_NORM_SCALE),
    "newton_schulz5": (NEWTON_SCHULZ5_COEFFS, 1.0),
}

# A user-supplied orthogonalizer, dion's signature: ``func(U, epsilon=eps) -> Tensor``.
OrthogonalizerFn = Callable[..., Tensor]


def orthogonalize(
    update: Tensor,
    sumsq: Tensor | None = None,
    *,
    method: str | OrthogonalizerFn = "polar_express",
    eps: float = 1e-8,
) -> Tensor:
    """Return the orthogonalized batch [B, m, n] in bf16 (not necessarily contiguous)."""
    if update.ndim != 3:
        raise ValueError(f"expected a batch [B, m, n], got shape {tuple(update.shape)}")
    if callable(method):
        return method(update, epsilon=eps)
    coeffs, norm_scale = ORTHOGONALIZERS[method]

    tall = update.size(-2) > update.size(-1)
    x = update.mT if tall else update
    if sumsq is None:
        sumsq = x.float().square().sum(dim=(-2, -1))
    scale = 1.0 / (sumsq.sqrt() * norm_scale + eps)
    # One bf16 multiply (fp32 inside, one rounding): no fp32 copy of the batch.
    x = x * scale.to(torch.bfloat16)[:, None, None]
    for a, b, c in coeffs:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return x.mT if tall else x
