"""Symmetric batched products for the orthogonalizers: ``out = alpha X W^T (+ beta Y) (+ d I)``.

X and W (default X) are [B, M, K] with any strides, Y (optional) and ``out`` are [B, M, M].
The result is symmetric (the caller's promise when W is not X), so only the tiles on and
below the diagonal are computed (T (T + 1) / 2 of T^2 for T tiles a side) and each
off-diagonal tile is also stored mirrored. Polar Express uses it twice an iteration:
``A = X X^T`` (K = n) and ``b A + c A A`` (X = A, K = M, Y = A: A A = A A^T because A is
symmetric). Gram Newton-Schulz multiplies polynomials of one Gram matrix, which commute, so
their products are symmetric too (W = the second factor, symmetric, so W^T = W), and adds
``a I`` on the diagonal. Accumulation in fp32, one rounding to out's dtype.

Two kernels: one that reads through pointers (any layout, one output tile a program) and,
for the 16-bit layouts TMA reads (``_tma.tma_layout``), a persistent one whose operands come
by TMA (``gram_tma.py``, with the tile mapping and epilogue both share). Their configs are
candidates of one tuning key, which holds that eligibility (``_tma.tma_enabled``: GPUs with TMA):
which kernel runs follows from shape, dtype and layout, never the batch. Both sum in the same
order (K steps of ``chunk``, fp32).

``sym_gram`` is the Triton launcher, ``sym_gram_reference`` the torch version it matches.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ._launch import (
    FP_FUSION,
    TUNER,
    Config,
    Memo,
    bench_ms,
    bucket,
    cdiv,
    dtype_name,
    launch_batched,
    tuning_batch,
)
from ._tma import tma_enabled, tma_layout
from ._triton import tl, triton
from .gram_tma import _epilogue, _launch_tma, _lower_tile, epilogue_args
from .normalize import NormScale, norm_scale_arg, normalize_scale
from .shape_classes import fitting, shape_class, worth_timing

# ``block``: the square output tile's side; ``chunk``: the K step of each tile's loop.
# Square tiles so that a tile and its mirror image are both whole tiles. 256-wide tiles
# would hold 64 Ki fp32 accumulators (spills) and leave only 6 of 9 tiles for M = 768.
GRAM_CONFIGS = (
    Config(block=128, chunk=64, num_warps=8, num_stages=4),
    Config(block=128, chunk=64, num_warps=4, num_stages=4),
    Config(block=128, chunk=128, num_warps=8, num_stages=3),
    Config(block=64, chunk=64, num_warps=4, num_stages=4),
    Config(block=64, chunk=128, num_warps=4, num_stages=3),
    Config(block=128, chunk=64, num_warps=8, num_stages=3),
    # The persistent TMA kernel (16-bit layouts TMA reads, ``tma_layout``): a flattened loop
    # issues the next item's loads during this one's epilogue.
    Config(block=128, chunk=64, num_warps=8, num_stages=4, tma=True, flatten=True),
    Config(block=128, chunk=64, num_warps=4, num_stages=4, tma=True, flatten=True),
    Config(block=128, chunk=64, num_warps=4, num_stages=5, tma=True, flatten=True),
    # Two programs a SM (4 warps, 3 stages: 96 KiB of shared memory each): one's epilogue,
    # a tile and its mirror stored, overlaps the other's K loop, which for K = M = 1024 is
    # only 16 steps (H200, bench/product_configs.py: 128 x 1024^2 0.271 ms against 0.278
    # for the best with one program a SM; 96 x 512x1024 on .mT 0.062 against 0.066).
    Config(
        block=128, chunk=64, num_warps=4, num_stages=3, tma=True, flatten=True, programs_per_sm=2
    ),
    Config(block=128, chunk=64, num_warps=8, num_stages=3, tma=True, warp_specialize=True),
    Config(
        block=64, chunk=64, num_warps=4, num_stages=4, tma=True, flatten=True, programs_per_sm=2
    ),
)
# Without TMA (a layout it cannot read, or the switch off): made once, not per launch.
GRAM_POINTER_CONFIGS = tuple(c for c in GRAM_CONFIGS if not c.tma)
GRAM_INTERPRETER_CONFIG = Config(block=32, chunk=32, num_warps=4, num_stages=1)


@triton.jit(do_not_specialize=("b_start",))
def _sym_gram_kernel(
    x,  # [B, M, K]
    w,  # [B, M, K], the second factor (x itself for a Gram matrix)
    y,  # [B, M, M], read only when HAS_Y
    out,  # [B, M, M]
    b_start,  # index of the matrix that grid row 0 computes
    M,
    K,
    stride_xb,
    stride_xm,
    stride_xk,
    stride_wb,
    stride_wm,
    stride_wk,
    stride_yb,
    stride_ym,
    stride_yn,
    stride_ob,
    stride_om,
    stride_on,
    alpha,
    beta,
    diag,
    sumsq,  # [B] fp32, read only when HAS_SCALE
    norm_scale,
    eps_ptr,  # fp32 [1], read only when HAS_SCALE
    HAS_Y: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    HAS_SCALE: tl.constexpr,  # x and w taken as s x and s w, s = inverse_norm(sumsq[i_b])
    SYMMETRIZE: tl.constexpr,  # diagonal tiles: upper half = the lower half, mirrored
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64) + b_start
    i, j = _lower_tile(i_t)

    r_i = i * BLOCK + tl.arange(0, BLOCK)
    r_j = j * BLOCK + tl.arange(0, BLOCK)
    o_k = tl.arange(0, BLOCK_K)
    x += i_b * stride_xb
    w += i_b * stride_wb
    # Rows past M wrap onto valid rows (no load masks); their results are never stored.
    p_a = x + (r_i % M)[:, None] * stride_xm + o_k[None, :] * stride_xk
    p_b = w + (r_j % M)[:, None] * stride_wm + o_k[None, :] * stride_wk

    b_acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            b_a = tl.load(p_a)
            b_b = tl.load(p_b)
        else:
            k_mask = o_k[None, :] < K - k * BLOCK_K
            b_a = tl.load(p_a, mask=k_mask, other=0.0)
            b_b = tl.load(p_b, mask=k_mask, other=0.0)
        b_acc = tl.dot(b_a, tl.trans(b_b), b_acc, input_precision=PRECISION)
        p_a += BLOCK_K * stride_xk
        p_b += BLOCK_K * stride_wk

    _epilogue(
        b_acc, i_b, i, j, y, out, M, stride_yb, stride_ym, stride_yn, stride_ob, stride_om,
        stride_on, alpha, beta, diag, sumsq, norm_scale, eps_ptr, HAS_Y, HAS_DIAG, HAS_SCALE,
        SYMMETRIZE, BLOCK, False,
    )  # fmt: skip


def _launch(
    x: Tensor,
    w: Tensor,
    y: Tensor | None,
    out: Tensor,
    alpha,
    beta,
    diag,
    symmetrize: bool,
    config: Config,
    scale: NormScale | None = None,
) -> None:
    if config.tma:
        _launch_tma(x, w, y, out, alpha, beta, diag, symmetrize, config, scale)
        return
    batch, m, k = x.shape
    tiles = cdiv(m, config.block)
    y_arg, args, constexprs = epilogue_args(y, out, alpha, beta, diag, symmetrize, scale)
    launch_batched(
        _sym_gram_kernel,
        tiles * (tiles + 1) // 2,
        batch,
        (x, w, y_arg, out),
        m,
        k,
        *x.stride(),
        *w.stride(),
        *args,
        **constexprs,
        EVEN_K=k % config.chunk == 0,
        BLOCK=config.block,
        BLOCK_K=config.chunk,
        **pointer_options(config, x.dtype),
    )


def pointer_options(config: Config, dtype: torch.dtype) -> dict:
    """A pointer product kernel's precision and launch options (``sym_gram``'s and
    ``poly_apply``'s kernels take the same): fp32 products in IEEE fp32, tf32 is ignored for
    16-bit."""
    return dict(
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=FP_FUSION,
    )


def sym_gram(
    x: Tensor,
    *,
    w: Tensor | None = None,
    alpha: float = 1.0,
    y: Tensor | None = None,
    beta: float = 0.0,
    diag: float = 0.0,
    symmetrize: bool = False,
    out: Tensor | None = None,
    sumsq: Tensor | None = None,
    norm_scale: float | None = None,
    eps: float | Tensor | None = None,
) -> Tensor:
    """``out = alpha x w^T + beta y + diag I`` for a batch x [B, M, K] (any strides) and
    ``w`` like x (default: x itself), where ``x w^T`` is symmetric; ``y`` [B, M, M] must be
    symmetric (only its lower tiles are read). ``out`` [B, M, M], any strides, must not
    overlap x, w or y. Returns out, its lower triangle mirrored (symmetric bit for bit) when
    ``w`` is given or ``symmetrize``.

    With ``sumsq`` ([B] fp32, contiguous), ``norm_scale`` and ``eps`` (a number or an fp32
    device tensor [1]): x and w are taken as normalized, ``s x`` and ``s w`` with
    ``s = bf16(1 / (sqrt(sumsq) * norm_scale + eps))`` per matrix (``normalize``'s scale),
    so ``out = alpha s^2 x w^T + beta y + diag I`` in fp32: Polar Express's first Gram
    matrix without the normalized copy of x."""
    if x.ndim != 3:
        raise ValueError(f"expected x [B, M, K], got shape {tuple(x.shape)}")
    batch, m, k = x.shape
    scale = norm_scale_arg(sumsq, norm_scale, eps, batch, x.device)
    if w is not None and (w.shape != x.shape or w.dtype != x.dtype or w.device != x.device):
        raise ValueError(f"w must be [{batch}, {m}, {k}] {x.dtype} on {x.device}")
    if out is None:
        out = torch.empty(batch, m, m, dtype=x.dtype, device=x.device)
    for name, t in (("out", out), ("y", y)):
        if t is not None and (t.shape != (batch, m, m) or t.device != x.device):
            raise ValueError(f"{name} must be [{batch}, {m}, {m}] on {x.device}")
    if batch * m == 0:
        return out
    if k == 0:  # (the scale multiplies the empty product: nothing to fold)
        out.copy_(y * beta) if y is not None else out.zero_()
        out.diagonal(dim1=-2, dim2=-1).add_(diag)
        return out
    symmetrize = symmetrize or w is not None
    # The config sets the order of the fp32 sums, so it depends on the shape and layout
    # only, never on the batch: a matrix gets the same bits in any batch.
    key, m_class, k_class = _tuning_key(x, w, y, out, symmetrize, scale is not None)

    def bench(config: Config) -> float:
        # Scratch inputs of the class's sizes and a batch fixed by them (same layouts), so the
        # choice depends on the class alone; scratch output.
        n = tuning_batch(m_class * max(k_class, m_class))
        sx = _scratch(x, n, m_class, k_class)
        sw = sx if w is None else _scratch(w, n, m_class, k_class)
        sy = None if y is None else _scratch(y, n, m_class, m_class)
        so = torch.empty(n, m_class, m_class, dtype=out.dtype, device=out.device)
        ss = None if scale is None else _scratch_scale(scale, n)
        return bench_ms(lambda: _launch(sx, sw, sy, so, alpha, beta, diag, symmetrize, config, ss))

    configs = fitting(GRAM_CONFIGS if key[-1] else GRAM_POINTER_CONFIGS, m_class)
    w = x if w is None else w
    # Every candidate inside compiling_ahead (``Tuner.choices``): x's sizes, not the class's.
    timing = bench if worth_timing(m_class, m_class) else None
    for config in TUNER.choices(
        "sym_gram", key, configs, GRAM_INTERPRETER_CONFIG, x.device, timing
    ):
        _launch(x, w, y, out, float(alpha), float(beta), float(diag), symmetrize, config, scale)
    return out


# ``_tuning_key``'s answers by what they depend on (the layouts of x and w among them:
# whether TMA reads them), so that a launch of a known layout reads no more of it.
_KEYS = Memo()


def _tuning_key(x, w, y, out, symmetrize: bool, scaled: bool) -> tuple:
    """(sym_gram's tuning key, m's class, k's class)."""
    memo_key = (
        x.shape[1:],
        x.stride(),
        x.dtype,
        x.data_ptr() % 16,
        x.device,
        None if w is None else (w.stride(), w.data_ptr() % 16),
        out.dtype,
        y is not None,
        symmetrize,
        scaled,
        os.environ.get("MUON_OFFLOAD_TMA"),  # tma_enabled's switch, read per call
    )
    found = _KEYS.get(memo_key)
    if found is not None:
        return found
    tma = (
        tma_enabled(x.device)
        and tma_layout(x) is not None
        and (w is None or tma_layout(w) is not None)
    )
    _, m, k = x.shape
    m_class, k_class = shape_class(m), bucket(k)
    key = (
        dtype_name(x.dtype),
        dtype_name(out.dtype),
        m_class,
        k_class,
        x.stride(-1) == 1,  # rows contiguous, or a transposed view
        None if w is None else w.stride(-1) == 1,
        y is not None,
        symmetrize,
        scaled,  # another compiled kernel (the scale's loads and multiply)
        tma,
    )
    return _KEYS.put(memo_key, (key, m_class, k_class))


def _scratch_scale(scale: NormScale, batch: int) -> NormScale:
    """``scale`` for a scratch batch of ``batch`` matrices: positive sums of squares."""
    sumsq = torch.rand(batch, device=scale.sumsq.device).add_(0.5)
    return scale._replace(sumsq=sumsq)


def _scratch(t: Tensor, batch: int, rows: int, cols: int) -> Tensor:
    """Random [batch, rows, cols] (a size class's) with t's dtype and the layout of t's last
    two dims: rows contiguous, or columns (a transposed view). The classes' sizes are
    multiples of 16 or powers of two, so each matrix starts on a 16-byte boundary and TMA
    takes the scratch when it takes t."""
    flat = torch.randn(batch * rows * cols, device=t.device).div_(cols**0.5).to(t.dtype)
    if t.stride(-2) == 1 and t.stride(-1) != 1:  # columns contiguous
        return flat.view(batch, cols, rows).mT
    return flat.view(batch, rows, cols)


def sym_gram_reference(
    x: Tensor,
    *,
    w: Tensor | None = None,
    alpha: float = 1.0,
    y: Tensor | None = None,
    beta: float = 0.0,
    diag: float = 0.0,
    symmetrize: bool = False,
    sumsq: Tensor | None = None,
    norm_scale: float | None = None,
    eps: float | Tensor | None = None,
) -> Tensor:
    """The same in fp32 (one rounding to x's dtype at the end); the lower triangle mirrored
    when ``w`` is given or ``symmetrize``."""
    acc = x.float() @ (x if w is None else w).float().mT
    if sumsq is None:
        acc = alpha * acc
    else:
        s = normalize_scale(sumsq, norm_scale=norm_scale, eps=eps).float()[:, None, None]
        acc = acc * (alpha * s) * s
    if y is not None:
        acc = acc + beta * y.float()
    if diag:
        acc = acc + diag * torch.eye(x.size(-2), device=x.device)
    if symmetrize or w is not None:
        acc = acc.tril() + acc.tril(-1).mT
    return acc.to(x.dtype)
