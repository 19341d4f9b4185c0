"""Orthogonalization of a batch of bf16 matrices: Polar Express and quintic Newton-Schulz.

Input: U [B, m, n] bf16 and, when the caller has it, each matrix's sum of squares
[B] fp32 (the Muon prep kernel produces it, so the normalization needs no extra pass).
Tall matrices (m > n) run on their transpose, so the Gram matrix X X^T is the small one.
Each iteration is X <- a X + (b A + c A A) X with A = X X^T, every bf16 intermediate
rounded once. The two symmetric products (A, and b A + c A A) run either on batched cuBLAS
(``bmm`` / ``baddbmm``) or on the Triton kernel of ``gram.py`` that computes only the tiles
on and below the diagonal; ``X <- a X + B X`` on cuBLAS ``baddbmm`` or on the Triton kernel
of ``poly_apply.py``, which writes into two buffers in turn (the scaled input is one of them
when it is contiguous).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .gram import sym_gram
from .normalize import normalize, normalize_reference
from .poly_apply import poly_apply

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


# Which products run on Triton: "triton" is the two symmetric ones, "triton_gram" /
# "triton_poly" one of them, "triton_apply" only X <- a X + B X, "triton_all" all three.
PRODUCTS = ("cublas", "triton", "triton_gram", "triton_poly", "triton_apply", "triton_all")


# Measured on one H200 (2026-11-29, torch 2.11 + cu130, triton 3.6; bench/orthogonalize.py,
# do_bench medians, whole 5-iteration Polar Express, bf16), cuBLAS -> both products on Triton,
# over two runs (three rounds; the spread between rounds is up to 9%):
#   128 x 768x2048                9.00 to 9.85 -> 7.77 to 8.07 ms
#   128 x 768x2048 on a .mT view  9.91 to 10.01 -> 8.84 to 9.76 ms (the experts' down proj.)
#   16 x 768x2048                 1.20 to 1.21 -> 1.09 to 1.16 ms
#   6 x 2048x4096                 4.88 -> 4.03 ms
#   12 x 512x2048                 0.58 -> 1.09 ms;  48 x 128x2048  0.59 -> 0.67 ms
# Alone, X X^T is 1.33x faster (0.453 -> 0.339 ms, 128 x 768x2048) and b A + c A A 1.72x
# (0.292 -> 0.170 ms). The small batches lose to the host cost of the launches (the products
# themselves take 20 to 30 us there). The outputs were bit-identical to cuBLAS's on all six.
# So: Triton from m = 768 and at least the work of the smallest measured win, 16 x 768x2048.
#
# X <- a X + B X, timed alone the same day (same card and versions, one run), cuBLAS baddbmm
# -> poly_apply: 0.744 -> 0.663 ms (128 x 768x2048; 0.576 to 0.61 in the tuner and a sweep:
# baddbmm copies X into its output before the product, bmm alone takes 0.44), 1.753 -> 0.702
# (the same on a .mT view: cuBLAS is slow on it), 0.102 -> 0.081 (16 x 768x2048), 0.383 ->
# 0.351 (6 x 2048x4096), 0.049 -> 0.036 (12 x 512x2048), 0.041 -> 0.027 (48 x 128x2048).
# Within 1.3e-5 relative RMS of cuBLAS's (rounding flips; both 1.6e-3 from float64). The whole
# Polar Express, "triton" (the symmetric products) -> "triton_all" (all three), two rounds:
#   128 x 768x2048                7.89 to 7.90 -> 7.42 to 8.15 ms (auto and triton_all rounds)
#   128 x 768x2048 on a .mT view  8.74 to 9.42 -> 7.44 to 7.50 ms
#   16 x 768x2048                 1.11 to 1.24 -> 1.06 to 1.29 ms (noise; alone it wins 20%)
#   6 x 2048x4096                 3.91 -> 3.83 to 3.84 ms
# (cuBLAS throughout: 9.09 to 9.11, 9.96 to 10.08, 1.21 to 1.22, 4.89 to 5.03 ms.) The
# result differs from cuBLAS's by 0.4% to 0.6% relative RMS after the five iterations, with the
# same error against float64 (1.07%, 1.10%, 1.07%, 0.92%). The small batches stay on cuBLAS:
# poly_apply's launch costs more host time than the product (0.84 to 1.20 ms against 0.57 to
# 0.81 for 12 x 512x2048). So: all three products on Triton where the symmetric ones are.
TRITON_MIN_ROWS = 768
TRITON_MIN_WORK = 16 * 768 * 768 * 2048  # batch * m^2 * n


def products_for(x: Tensor) -> str:
    """The path of the products for a CUDA batch x [B, m, n] (m <= n, the orientation the
    iteration runs in): the faster one measured (numbers above)."""
    batch, m, n = x.shape
    if x.dtype == torch.bfloat16 and m >= TRITON_MIN_ROWS and batch * m * m * n >= TRITON_MIN_WORK:
        return "triton_all"
    return "cublas"


def orthogonalize(
    update: Tensor,
    sumsq: Tensor | None = None,
    *,
    method: str | OrthogonalizerFn = "polar_express",
    eps: float = 1e-8,
) -> Tensor:
    """Return the orthogonalized batch [B, m, n] in bf16 (not necessarily contiguous)."""
    return orthogonalize_on(update, sumsq, method=method, eps=eps, products="auto")


def orthogonalize_on(
    update: Tensor,
    sumsq: Tensor | None = None,
    *,
    method: str | OrthogonalizerFn = "polar_express",
    eps: float = 1e-8,
    products: str = "auto",
) -> Tensor:
    """``orthogonalize`` with the products' path named: ``"cublas"`` (torch ``bmm`` /
    ``baddbmm``), ``"triton"`` (both symmetric products on ``sym_gram``; CUDA, or the CPU
    under the Triton interpreter), ``"triton_gram"`` / ``"triton_poly"`` (only ``X X^T`` /
    only ``b A + c A A`` on ``sym_gram``), ``"triton_apply"`` (only ``a X + B X``, on
    ``poly_apply``), ``"triton_all"`` (all three), or ``"auto"``: ``products_for(x)`` on
    CUDA, else ``"cublas"``."""
    if update.ndim != 3:
        raise ValueError(f"expected a batch [B, m, n], got shape {tuple(update.shape)}")
    if products != "auto" and products not in PRODUCTS:
        raise ValueError(f"products must be 'auto' or one of {PRODUCTS}, got {products!r}")
    if callable(method):
        return method(update, epsilon=eps)
    coeffs, norm_scale = ORTHOGONALIZERS[method]

    tall = update.size(-2) > update.size(-1)
    x = update.mT if tall else update
    if sumsq is None:
        sumsq = x.float().square().sum(dim=(-2, -1))
    if products == "auto":
        products = products_for(x) if x.is_cuda else "cublas"
    # One bf16 multiply per element (fp32 inside, one rounding): no fp32 copy of the batch.
    # The kernel and the torch expression round alike; the kernel runs on CUDA, and on the
    # CPU (interpreter) when a Triton path is asked for. Its output is a fresh tensor, which
    # poly_apply's buffer rotation below may write into.
    if x.dtype == torch.bfloat16 and (x.is_cuda or products != "cublas"):
        x = normalize(x, sumsq, norm_scale=norm_scale, eps=eps)
    else:
        x = normalize_reference(x, sumsq, norm_scale=norm_scale, eps=eps)
    tri_gram = products in ("triton", "triton_gram", "triton_all")
    tri_poly = products in ("triton", "triton_poly", "triton_all")
    tri_apply = products in ("triton_apply", "triton_all")
    m = x.size(-2)
    gram_buf = x.new_empty(x.size(0), m, m) if tri_gram else None
    poly_buf = x.new_empty(x.size(0), m, m) if tri_poly else None
    spare = None  # poly_apply's next output: the buffer that the previous iteration read
    for a, b, c in coeffs:
        gram = sym_gram(x, out=gram_buf) if tri_gram else torch.bmm(x, x.mT)
        if tri_poly:
            poly = sym_gram(gram, alpha=c, y=gram, beta=b, out=poly_buf)
        else:
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        if tri_apply:
            # x is ours (the scaled copy, or a buffer of this loop); a .mT-laid-out first x
            # is not reused, so every output is contiguous, as baddbmm's are.
            out = spare if spare is not None else x.new_empty(x.shape)
            spare = x if x.is_contiguous() else None
            x = poly_apply(poly, x, alpha=a, out=out)
        else:
            x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return x.mT if tall else x
