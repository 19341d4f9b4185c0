"""Orthogonalization of a batch of bf16 matrices: Polar Express, quintic Newton-Schulz, and
Gram Newton-Schulz (``gram_newton_schulz.py``: the same steps carried on X X^T).

Input: U [B, m, n] bf16 and, when the caller has it, each matrix's sum of squares
[B] fp32 (the Muon prep kernel produces it, so the normalization needs no extra pass).
Tall matrices (m > n) run on their transpose, so the Gram matrix X X^T is the small one.
X0 = s U with s = bf16(1 / (norm * norm_scale + eps)) per matrix; then each iteration is
X <- a X + (b A + c A A) X with A = X X^T, every bf16 intermediate rounded once. The two
symmetric products (A, and b A + c A A) run either on batched cuBLAS (``bmm`` /
``baddbmm``) or on the Triton kernel of ``gram.py`` that computes only the tiles on and
below the diagonal; ``X <- a X + B X`` on cuBLAS ``baddbmm`` or on the Triton kernel of
``poly_apply.py``, which writes into two buffers in turn.

Where all three products run on Triton ("triton_all", CUDA's path for bf16; Polar Express
and Newton-Schulz5 on bf16 or fp32), the normalization is folded into the first iteration:
A = s^2 U U^T (``sym_gram``'s scale) and X1 = s (a U + B U) (``poly_apply``'s), so X0 is
never formed (one pass over the batch fewer, and one bf16 rounding fewer) and the caller's
U is only read. Elsewhere ``normalize.py`` writes X0 into a fresh buffer first (one of the
two that poly_apply then writes into in turn, when it is contiguous). Gram Newton-Schulz
always normalizes first (fp16, its own scale).

``orthogonalize_apply_`` adds Muon's apply (``muon.py``): where the last product is
``poly_apply``'s, its epilogue rounds X5 as it would be stored and steps the parameters with
the apply kernel's expression instead, so X5 is never written nor read back; elsewhere it
orthogonalizes and then launches the apply kernel. The same bits either way.

A matrix's result does not depend on the batch it came in: on CUDA every choice (the
products' path, each kernel's config, the order of the norm's sum) follows from the
matrix's shape, dtype and layout, and no cuBLAS call (whose algorithm follows the batch
count) runs on 16-bit batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .gram import sym_gram
from .gram_newton_schulz import GRAM_NS_COEFFS, GRAM_NS_RESETS, gram_newton_schulz, work_dtype
from .muon import muon_apply_from_, param_apply
from .muon_apply import check_apply
from .normalize import normalize, normalize_reference
from .poly_apply import ParamApply, poly_apply
from .sumsq import sum_squares, sum_squares_reference

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


@dataclass(frozen=True)
class Method:
    coeffs: tuple
    norm_scale: float  # the input is divided by ``norm * norm_scale + eps``
    # Gram Newton-Schulz (its iterations that restart from X), None for the iteration on X.
    gram_resets: tuple[int, ...] | None = None


ORTHOGONALIZERS = {
    "polar_express": Method(POLAR_EXPRESS_COEFFS, POLAR_EXPRESS_NORM_SCALE),
    "newton_schulz5": Method(NEWTON_SCHULZ5_COEFFS, 1.0),
    "gram_newton_schulz": Method(GRAM_NS_COEFFS, 1.0, GRAM_NS_RESETS),
}

# A user-supplied orthogonalizer, dion's signature: ``func(U, epsilon=eps) -> Tensor``.
OrthogonalizerFn = Callable[..., Tensor]


# Which products run on Triton: "triton" is the two symmetric ones, "triton_gram" /
# "triton_poly" one of them, "triton_apply" only X <- a X + B X, "triton_all" all three.
# (Gram Newton-Schulz: "gram" is R = X X^T, "poly" its m x m products, "apply" Q X.)
PRODUCTS = ("cublas", "triton", "triton_gram", "triton_poly", "triton_apply", "triton_all")


def products_for(x: Tensor) -> str:
    """The path of the products for a CUDA batch x [B, m, n] (m <= n): from its dtype alone,
    never its size, so that a matrix gets the same bits in a batch of any size (cuBLAS picks
    its algorithm from the batch count too). Triton for 16-bit batches: as fast or faster
    than cuBLAS from 16 x 768x2048 up, 1.1 to 1.5x slower on the small ones (12 x 512x2048,
    48 x 128x2048: launch costs), which are 2 of a resident step's ~33 batches."""
    return "triton_all" if x.dtype in (torch.bfloat16, torch.float16) else "cublas"


def orthogonalize(
    update: Tensor,
    sumsq: Tensor | None = None,
    *,
    method: str | OrthogonalizerFn = "polar_express",
    eps: float | Tensor = 1e-8,
) -> Tensor:
    """Return the orthogonalized batch [B, m, n] in bf16 (not necessarily contiguous). ``eps``:
    a number, or an fp32 device tensor holding it (read by the kernels that scale)."""
    return orthogonalize_on(update, sumsq, method=method, eps=eps, products="auto")


def orthogonalize_on(
    update: Tensor,
    sumsq: Tensor | None = None,
    *,
    method: str | OrthogonalizerFn = "polar_express",
    eps: float | Tensor = 1e-8,
    products: str = "auto",
) -> Tensor:
    """``orthogonalize`` with the products' path named: ``"cublas"`` (torch ``bmm`` /
    ``baddbmm``), ``"triton"`` (both symmetric products on ``sym_gram``; CUDA, or the CPU
    under the Triton interpreter), ``"triton_gram"`` / ``"triton_poly"`` (only ``X X^T`` /
    only ``b A + c A A`` on ``sym_gram``), ``"triton_apply"`` (only ``a X + B X``, on
    ``poly_apply``), ``"triton_all"`` (all three), or ``"auto"``: ``products_for(x)`` on
    CUDA, else ``"cublas"``."""
    return _orthogonalize(update, sumsq, method, eps, products, None)


def orthogonalize_apply_(
    update: Tensor,
    sumsq: Tensor | None,
    params: Sequence[Tensor],
    scalars: Tensor,
    *,
    method: str | OrthogonalizerFn = "polar_express",
    eps: float | Tensor = 1e-8,
    products: str = "auto",
) -> None:
    """``muon_apply_from_(params, orthogonalize_on(update, ...), scalars)``, bit for bit:
    ``params`` (contiguous, one of rows x cols elements per matrix of update [B, rows, cols],
    read row-major) become ``p (1 - lr wd) - adjusted_lr O``, ``scalars`` the apply's fp32
    [2]. Where the last product runs on ``poly_apply`` (``"triton_apply"``, ``"triton_all"``;
    Gram Newton-Schulz on non-square matrices), its epilogue applies and O is never stored;
    elsewhere the two run one after the other."""
    rows, cols = check_apply(params, update, scalars)  # before anything is launched
    if rows * cols == 0:
        return
    apply_to = param_apply(params, cols, scalars)
    ortho = _orthogonalize(update, sumsq, method, eps, products, apply_to)
    if ortho is not None:  # a path whose last product is not poly_apply's
        muon_apply_from_(params, ortho, scalars)


def _orthogonalize(update, sumsq, method, eps, products, apply_to) -> Tensor | None:
    """``orthogonalize_on``; with ``apply_to``, the last product applies it where that product
    is ``poly_apply``'s, and None is returned (the result otherwise)."""
    if update.ndim != 3:
        raise ValueError(f"expected a batch [B, m, n], got shape {tuple(update.shape)}")
    if products != "auto" and products not in PRODUCTS:
        raise ValueError(f"products must be 'auto' or one of {PRODUCTS}, got {products!r}")
    if callable(method):
        return method(update, epsilon=eps)
    spec = ORTHOGONALIZERS[method]

    tall = update.size(-2) > update.size(-1)
    x = update.mT if tall else update
    if products == "auto":
        products = products_for(x) if x.is_cuda else "cublas"
    # The CPU runs the kernels only when a Triton path is asked for: "auto" is resolved
    # first, so it keeps the torch expressions there, as the optimizer's other CPU steps do.
    # (The interpreter truncates fp32 -> bf16 where torch and the GPU round to nearest: the
    # interpreted normalization lowered the scale and each element of X by up to a bf16 ulp,
    # which took test_math's 3-D updates from 2.1% to 3.9% off float64.)
    kernels = x.is_cuda or products != "cublas"
    if sumsq is None:
        # The kernel's order is the prep kernel's, fixed per shape: the same bits as a
        # sumsq handed over by prep, and in any batch.
        sumsq = sum_squares(x) if kernels else sum_squares_reference(x)
    tri_gram = products in ("triton", "triton_gram", "triton_all")
    tri_poly = products in ("triton", "triton_poly", "triton_all")
    tri_apply = products in ("triton_apply", "triton_all")
    # The parameters in x's orientation, for a last product on poly_apply.
    fused = None if apply_to is None or not tri_apply else apply_to.mT if tall else apply_to
    if spec.gram_resets is not None:
        # fp32 scale, one rounding into the working dtype (fp16 for 16-bit input).
        x = (normalize if kernels else normalize_reference)(
            x, sumsq, norm_scale=1.0, eps=eps, out_dtype=work_dtype(x.dtype), round_scale=False
        )
        if x.size(-2) < x.size(-1):
            x = gram_newton_schulz(
                x,
                coeffs=spec.coeffs,
                resets=spec.gram_resets,
                tri_gram=tri_gram,
                tri_poly=tri_poly,
                tri_apply=tri_apply,
                out_dtype=update.dtype,
                apply_to=fused,
            )
        else:  # square: nothing to gain, the iteration on X (as the package does)
            x = _iterate(x, spec.coeffs, tri_gram, tri_poly, tri_apply).to(update.dtype)
    elif products == "triton_all" and x.dtype in (torch.bfloat16, torch.float32):
        # The normalization folded into the first iteration (sym_gram's and poly_apply's
        # scale): no pass over the batch, and X0 = s U is never rounded. fp16 input keeps the
        # torch expression below, whose bf16 scale promotes it to fp32.
        scale = dict(sumsq=sumsq, norm_scale=spec.norm_scale, eps=eps)
        x = _iterate(x, spec.coeffs, tri_gram, tri_poly, tri_apply, scale=scale, apply_to=fused)
    else:
        # One bf16 multiply per element (fp32 inside, one rounding): no fp32 copy of the
        # batch. The kernel and the torch expression round alike; the kernel runs on CUDA,
        # and on the CPU (interpreter) when a Triton path is asked for. Its output is a fresh
        # tensor, which poly_apply's buffer rotation below may write into.
        if x.dtype == torch.bfloat16 and kernels:
            x = normalize(x, sumsq, norm_scale=spec.norm_scale, eps=eps)
        else:
            x = normalize_reference(x, sumsq, norm_scale=spec.norm_scale, eps=eps)
        x = _iterate(x, spec.coeffs, tri_gram, tri_poly, tri_apply, apply_to=fused)
    if x is None:  # applied
        return None
    return x.mT if tall else x


def _iterate(
    x: Tensor,
    coeffs,
    tri_gram: bool,
    tri_poly: bool,
    tri_apply: bool,
    scale: dict | None = None,
    apply_to: ParamApply | None = None,
) -> Tensor | None:
    """X <- a X + (b A + c A A) X with A = X X^T, per coefficient triple, on x [B, m, n].
    With ``scale`` (sym_gram's and poly_apply's keywords; both on Triton): x is the caller's
    unnormalized batch, scaled inside the first iteration's Gram and apply, and only read.
    With ``apply_to`` (poly_apply's, on Triton): the last apply goes to the parameters
    instead of a last X, and None is returned."""
    if scale is not None and not (tri_gram and tri_apply):
        raise ValueError("the scale folds into sym_gram and poly_apply: both on Triton")
    if apply_to is not None and not tri_apply:
        raise ValueError("apply_to is poly_apply's: the last product on Triton")
    m = x.size(-2)
    gram_buf = x.new_empty(x.size(0), m, m) if tri_gram else None
    poly_buf = x.new_empty(x.size(0), m, m) if tri_poly else None
    ours = scale is None  # the caller's x is never written; normalize's copy is ours
    spare = None  # poly_apply's next output: the buffer that the previous iteration read
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        first = scale or {}  # the scale applies to the first iteration's x only
        gram = sym_gram(x, out=gram_buf, **first) if tri_gram else torch.bmm(x, x.mT)
        if tri_poly:
            poly = sym_gram(gram, alpha=c, y=gram, beta=b, out=poly_buf)
        else:
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        if tri_apply and apply_to is not None and i == last:
            return poly_apply(poly, x, alpha=a, apply_to=apply_to, **first)
        if tri_apply:
            # x becomes the next output once read, when it is ours (normalize's copy, or a
            # buffer of this loop) and contiguous: a .mT-laid-out first x is not reused, so
            # every output is contiguous, as baddbmm's are. The caller's U (the first x with
            # the scale) is never written: two fresh buffers either way.
            out = spare if spare is not None else x.new_empty(x.shape)
            spare = x if ours and x.is_contiguous() else None
            x = poly_apply(poly, x, alpha=a, out=out, **first)
        else:
            x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
        scale, ours = None, True
    return x
