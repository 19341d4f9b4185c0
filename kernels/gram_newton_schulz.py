"""Gram Newton-Schulz: Polar Express iterated on the small Gram matrix R = X X^T, not on X.

The algorithm of the ``gram-newton-schulz`` package (Dao-AILab, 0.1.6), which dion's
``use_gram_newton_schulz=True`` calls with ``gram_newton_schulz_reset_iterations=[2]``. For a
wide X [m, n] (m < n; tall ones run on the transpose) each Polar Express step is
``X <- P(R) X`` with ``P(R) = a I + b R + c R^2``; every P is a polynomial in the same R, so
they commute, and the steps can be carried on m x m matrices only:

    R = X X^T
    step i:  P = a I + b R + c R R
             Q = P                    (first step, or a restart)
             Q = Q P                  (otherwise)
             R = P (R P)              (unless the next step restarts, or this is the last)
    restart (before step 2):  X = Q X, R = X X^T
    X = Q X

The product of symmetric commuting factors is symmetric: every m x m product runs on
``sym_gram`` (the tiles on and below the diagonal, mirrored, so each result is symmetric
bit for bit: an asymmetry would grow from product to product), the two ``Q X`` on
``poly_apply``. A
restart re-forms R from X, so the rounding that R accumulates over the steps before it
does not carry on. The X-sized products are 3 against Polar Express's 10 (dion's count:
~58% fewer FLOPs for the usual aspect ratios). Square matrices gain nothing: the package runs
standard Newton-Schulz on them with the same coefficients (``orthogonalize.py`` does too).

Like the package, the input is divided by ``norm + eps`` (no 1.02 factor: these coefficients
carry their own safety factor) and the iteration runs in fp16, whose 10-bit mantissa the
Gram form needs (R is formed once and updated four times); fp32 inputs stay fp32. Where the
package rounds ``Z = b R + c R R`` and then adds ``a I`` (or ``a Q``, ``a R`` in the next
products), this carries ``P = Z + a I`` itself, rounded once: the same polynomial with one
rounding fewer on R and Q. The result is rounded once, from fp32, to the caller's dtype
(the package rounds to fp16 first, then to bf16).

``gram_newton_schulz`` runs the iteration on the products the caller names (Triton kernels
or torch); ``orthogonalize.py`` normalizes and dispatches.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .gram import sym_gram
from .poly_apply import ParamApply, poly_apply

# Polar Express (Amsel et al., arXiv:2505.16932), the package's coefficients: the paper's,
# divided by a safety factor of 1.05 (a / 1.05, b / 1.05^3, c / 1.05^5), for inputs divided
# by ``norm + eps``.
_UNMODIFIED = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
GRAM_NS_SAFETY = 1.05
GRAM_NS_COEFFS = tuple(
    (a / GRAM_NS_SAFETY, b / GRAM_NS_SAFETY**3, c / GRAM_NS_SAFETY**5) for a, b, c in _UNMODIFIED
)
GRAM_NS_RESETS = (2,)  # dion's gram_newton_schulz_reset_iterations
GRAM_NS_EPS = 1e-7  # the package's ns_epsilon (dion passes it no epsilon)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the iteration runs in: fp16 for 16-bit inputs (as the package), else fp32."""
    return torch.float16 if dtype in (torch.bfloat16, torch.float16) else dtype


class _Buffers:
    """m x m scratch matrices handed out and back, so no product writes over its inputs."""

    def __init__(self, like: Tensor, m: int):
        self.like, self.m, self.free = like, m, []

    def take(self) -> Tensor:
        if self.free:
            return self.free.pop()
        return self.like.new_empty(self.like.size(0), self.m, self.m)

    def give(self, *ts: Tensor) -> None:
        self.free.extend(ts)


def gram_newton_schulz(
    x: Tensor,
    *,
    coeffs=GRAM_NS_COEFFS,
    resets=GRAM_NS_RESETS,
    tri_gram: bool,
    tri_poly: bool,
    tri_apply: bool,
    out_dtype: torch.dtype,
    apply_to: ParamApply | None = None,
) -> Tensor | None:
    """The iteration above on a normalized wide batch x [B, m, n] (m <= n, any strides, in
    the working dtype). ``tri_gram``: R = X X^T on ``sym_gram``; ``tri_poly``: the m x m
    products on ``sym_gram``; ``tri_apply``: Q X on ``poly_apply``; each otherwise on torch
    (cuBLAS on CUDA). Returns [B, m, n] in ``out_dtype``; with ``apply_to`` (``tri_apply``),
    the last Q X goes to the parameters instead (``poly_apply``'s), and None."""
    if apply_to is not None and not tri_apply:
        raise ValueError("apply_to is poly_apply's: Q X on Triton (tri_apply)")
    m = x.size(-2)
    bufs = _Buffers(x, m)

    def gram(t: Tensor) -> Tensor:
        return sym_gram(t, symmetrize=True, out=bufs.take()) if tri_gram else torch.bmm(t, t.mT)

    def poly(r: Tensor, a: float, b: float, c: float) -> Tensor:
        if tri_poly:
            return sym_gram(r, alpha=c, y=r, beta=b, diag=a, symmetrize=True, out=bufs.take())
        p = torch.baddbmm(r, r, r, beta=b, alpha=c)
        p.diagonal(dim1=-2, dim2=-1).add_(a)
        return p

    def mul(s: Tensor, t: Tensor) -> Tensor:  # s t for commuting symmetric s, t
        return sym_gram(s, w=t, out=bufs.take()) if tri_poly else torch.bmm(s, t)

    def apply(q: Tensor, t: Tensor, dtype: torch.dtype, to: ParamApply | None = None):
        if tri_apply:
            return poly_apply(q, t, alpha=0.0, out_dtype=dtype, apply_to=to)
        return torch.bmm(q, t).to(dtype)

    r = gram(x)
    q = None
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        if i in resets and i != 0:
            x = apply(q, x, x.dtype)
            bufs.give(q, r)
            r, q = gram(x), None
        p = poly(r, a, b, c)
        if q is None:
            q = p
        else:
            q_next = mul(q, p)
            bufs.give(q)
            q = q_next
        if i < last and i + 1 not in resets:
            rp = mul(r, p)
            bufs.give(r)
            r = mul(p, rp)
            bufs.give(rp)
        if p is not q:
            bufs.give(p)
    return apply(q, x, out_dtype, apply_to)
