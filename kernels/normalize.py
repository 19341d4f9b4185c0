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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import (
    FP_FUSION,
    TUNER,
    Config,
    bench_ms,
    bucket,
    dtype_name,
    interpreted,
    scalar_arg,
)
from .sumsq import flat_matrices

NORMALIZE_CONFIGS = (
    Config(block=4096, chunk=32768, num_warps=8),
    Config(block=2048, chunk=16384, num_warps=4),
    Config(block=8192, chunk=65536, num_warps=16),
    Config(block=2048, chunk=8192, num_warps=8),
)
NORMALIZE_INTERPRETER_CONFIG = Config(block=256, chunk=1024, num_warps=4)
MAX_GRID_Y = 65535


@triton.jit
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
    s = tl.load(sumsq + i_b)
    eps = tl.load(eps_ptr)
    scale = tl.div_rn(1.0, tl.sqrt_rn(s) * norm_scale + eps)
    if ROUND_SCALE:
        scale = scale.to(tl.bfloat16).to(tl.float32)
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
    if sumsq.shape != (u.size(0),) or sumsq.dtype != torch.float32 or sumsq.device != u.device:
        raise ValueError(f"sumsq must be float32 [{u.size(0)}] on {u.device}")
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
        grid_x = triton.cdiv(numel, config.chunk)
        for start in range(0, batch, MAX_GRID_Y):
            _normalize_kernel[(grid_x, min(batch - start, MAX_GRID_Y))](
                flat,
                target,
                sumsq,
                start,
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
    config = TUNER.choose(
        "normalize", key, NORMALIZE_CONFIGS, NORMALIZE_INTERPRETER_CONFIG, u.device, bench
    )
    launch(config, out)
    return _like(out, u)


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
    scale = 1.0 / (sumsq.sqrt() * norm_scale + eps)
    if round_scale:
        return u * scale.to(torch.bfloat16)[:, None, None]
    return (u.float() * scale[:, None, None]).to(out_dtype)
