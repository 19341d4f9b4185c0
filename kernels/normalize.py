"""The orthogonalizer's first pass: each matrix of a batch divided by its norm.

``x = u * bf16(1 / (sqrt(sumsq) * norm_scale + eps))``, one rounding to bf16, with ``sumsq``
[B] fp32 from the Muon prep kernel (Polar Express); or, with ``round_scale=False``, the
scale kept in fp32 and the product rounded once to ``out_dtype`` (Gram Newton-Schulz's
fp16 start). The torch expression (``normalize_reference``) is a
broadcast multiply, which PyTorch runs on its non-vectorized element-wise path: 17 ms of a
0.18 s resident step on the H200 (bench/profile_step.py, 2026-11-29). The kernel works on
each matrix's storage as a flat run of elements (the scale is per matrix, so the layout
inside a matrix does not matter) and folds the scale's four scalar ops into the same launch.
Both round identically: fp32 square root and division rounded to nearest, the scale rounded
to bf16 (or not), then the product in fp32 rounded once. Element-wise: no config changes a bit.

The scale itself (``inverse_norm`` in Triton, ``normalize_scale`` in torch) is shared with
the products that fold the normalization into Polar Express's first iteration instead
(``sym_gram`` and ``poly_apply`` with ``sumsq``; ``orthogonalize.py`` says where).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._launch import (
    FP_FUSION,
    TUNER,
    Config,
    bench_ms,
    bucket,
    cdiv,
    dtype_name,
    interpreted,
    launch_batched,
    scalar_arg,
)
from ._triton import tl, triton
from .config import chunked
from .sumsq import flat_matrices

NORMALIZE_CONFIGS = chunked((4096, 32768, 8), (2048, 16384, 4), (8192, 65536, 16), (2048, 8192, 8))
NORMALIZE_INTERPRETER_CONFIG = Config(block=256, chunk=1024, num_warps=4)


@triton.jit
def inverse_norm(sumsq, i_b, norm_scale, eps_ptr, ROUND_SCALE: tl.constexpr):
    """Matrix i_b's scale, fp32: ``1 / (sqrt(sumsq[i_b]) * norm_scale + eps)``, square root and
    division rounded to nearest; with ROUND_SCALE, then rounded to bf16 (to nearest even) and
    back. Shared with the products that fold the scale in (``gram.py``, ``poly_apply.py``),
    so that they and this kernel scale by the same number."""
    s = tl.div_rn(1.0, tl.sqrt_rn(tl.load(sumsq + i_b)) * norm_scale + tl.load(eps_ptr))
    if ROUND_SCALE:
        # By its bits, not by a cast: the same rounding as the GPU's cast, also under the
        # interpreter, whose fp32 -> bf16 casts truncate (the scale would then be up to an
        # ulp smaller on the CPU than torch's, and than the GPU's).
        bits = s.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        s = bits.to(tl.float32, bitcast=True)
    return s


@triton.jit(do_not_specialize=("b_start",))
def _normalize_kernel(
    u,  # [B, numel], each matrix's storage contiguous
    out,  # [B, numel]
    sumsq,  # [B] fp32
    b_start,
    numel,
    norm_scale,
    eps_ptr,  # fp32 [1]: eps, read from memory (a CUDA graph replays a changed one)
    ROUND_SCALE: tl.constexpr,  # the scale rounded to bf16 first
    EVEN: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i_b = tl.program_id(1).to(tl.int64) + b_start
    start = tl.program_id(0).to(tl.int64) * CHUNK
    scale = inverse_norm(sumsq, i_b, norm_scale, eps_ptr, ROUND_SCALE)
    base = i_b * numel + start
    for k in tl.range(0, CHUNK, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        if EVEN:
            x = tl.load(u + base + offs).to(tl.float32)
            tl.store(out + base + offs, (x * scale).to(out.dtype.element_ty))
        else:
            mask = offs < numel - start
            x = tl.load(u + base + offs, mask=mask).to(tl.float32)
            tl.store(out + base + offs, (x * scale).to(out.dtype.element_ty), mask=mask)


FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def normalize(
    u: Tensor,
    sumsq: Tensor,
    *,
    norm_scale: float,
    eps: float | Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    round_scale: bool = True,
) -> Tensor:
    """``u`` [B, m, n] (bf16, or fp16 / fp32) scaled per matrix into ``out_dtype``; the result
    has u's shape and strides when u (or its ``.mT``) is contiguous, which is what the prep
    kernel and the collectives give. ``eps``: a number or an fp32 device tensor holding it
    (the engine's step table); ``norm_scale`` is the method's constant."""
    if u.ndim != 3 or u.dtype not in FLOATS or out_dtype not in FLOATS:
        raise ValueError(
            f"expected a bf16, fp16 or fp32 batch [B, m, n] and such an out_dtype, got "
            f"{u.dtype} {tuple(u.shape)} -> {out_dtype}"
        )
    check_sumsq(sumsq, u.size(0), u.device)
    flat = flat_matrices(u)
    if flat is None or not (u.is_cuda or interpreted()):
        return normalize_reference(
            u, sumsq, norm_scale=norm_scale, eps=eps, out_dtype=out_dtype, round_scale=round_scale
        )
    batch, numel = flat.shape
    eps = scalar_arg(eps, u.device)
    out = torch.empty_like(flat, dtype=out_dtype)
    if batch * numel == 0:
        return _like(out, u)

    def launch(config: Config, target: Tensor) -> None:
        launch_batched(
            _normalize_kernel,
            cdiv(numel, config.chunk),
            batch,
            (flat, target, sumsq),
            numel,
            float(norm_scale),
            eps,
            ROUND_SCALE=round_scale,
            EVEN=numel % config.chunk == 0,
            BLOCK=config.block,
            CHUNK=config.chunk,
            num_warps=config.num_warps,
            enable_fp_fusion=FP_FUSION,
        )

    def bench(config: Config) -> float:
        scratch = torch.empty_like(out)  # reads u and sumsq only
        return bench_ms(lambda: launch(config, scratch))

    key = (bucket(numel), dtype_name(u.dtype), dtype_name(out_dtype))  # never the batch
    # Every candidate inside compiling_ahead (``Tuner.choices``).
    for config in TUNER.choices(
        "normalize", key, NORMALIZE_CONFIGS, NORMALIZE_INTERPRETER_CONFIG, u.device, bench
    ):
        launch(config, out)
    return _like(out, u)


def check_sumsq(sumsq: Tensor, batch: int, device: torch.device) -> None:
    """A batch's sums of squares as the kernels read them: contiguous fp32 [batch]."""
    if (
        not isinstance(sumsq, Tensor)
        or sumsq.shape != (batch,)
        or sumsq.dtype != torch.float32
        or sumsq.device != device
        or not sumsq.is_contiguous()
    ):
        raise ValueError(f"sumsq must be contiguous float32 [{batch}] on {device}")


class NormScale(NamedTuple):
    """The per-matrix scale of a batch, for the products that fold it in (``sym_gram``,
    ``poly_apply``): what ``normalize`` multiplies by, ``inverse_norm`` of each matrix's
    ``sumsq`` with the method's ``norm_scale`` and ``eps`` (an fp32 device tensor [1])."""

    sumsq: Tensor
    norm_scale: float
    eps: Tensor


def scale_kernel_args(scale: NormScale | None, unread: Tensor) -> tuple[Tensor, float, Tensor]:
    """A product kernel's (sumsq, norm_scale, eps_ptr) arguments: ``scale``'s, or, without one
    (HAS_SCALE off, never read), ``unread`` in the two pointer places."""
    return tuple(scale) if scale is not None else (unread, 1.0, unread)


def norm_scale_arg(
    sumsq: Tensor | None,
    norm_scale: float | None,
    eps: float | Tensor | None,
    batch: int,
    device: torch.device,
) -> NormScale | None:
    """A launcher's optional scale keywords, validated before anything launches: all three,
    or none (None)."""
    if sumsq is None:
        if norm_scale is not None or eps is not None:
            raise ValueError("norm_scale and eps scale by sumsq: give sumsq too")
        return None
    check_sumsq(sumsq, batch, device)
    if norm_scale is None or eps is None:
        raise ValueError("sumsq needs norm_scale and eps (the method's)")
    return NormScale(sumsq, float(norm_scale), scalar_arg(eps, device))


def _like(flat_out: Tensor, u: Tensor) -> Tensor:
    b, m, n = u.shape
    return flat_out.view(b, m, n) if u.is_contiguous() else flat_out.view(b, n, m).mT


def normalize_reference(
    u: Tensor,
    sumsq: Tensor,
    *,
    norm_scale: float,
    eps: float | Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    round_scale: bool = True,
) -> Tensor:
    """The torch expression the kernel matches (``eps`` a number or a one-element fp32 tensor:
    the same fp32 sum either way) (with ``round_scale``, a bf16 u times the bf16
    scale, in u's dtype promoted with bf16, as Polar Express has always run)."""
    scale = normalize_scale(sumsq, norm_scale=norm_scale, eps=eps, round_scale=round_scale)
    if round_scale:
        return u * scale[:, None, None]
    return (u.float() * scale[:, None, None]).to(out_dtype)


def normalize_scale(
    sumsq: Tensor, *, norm_scale: float, eps: float | Tensor, round_scale: bool = True
) -> Tensor:
    """Each matrix's scale [B], ``inverse_norm``'s in torch: fp32, or rounded to bf16."""
    scale = 1.0 / (sumsq.sqrt() * norm_scale + eps)
    return scale.to(torch.bfloat16) if round_scale else scale
