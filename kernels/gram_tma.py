"""``sym_gram``'s persistent TMA kernel (``gram.py`` has the launcher that chooses it), and
the tile mapping and epilogue it shares with the pointer kernel there: a loop over (matrix,
lower-triangle tile) items, operands read through host TMA descriptors as 3-D [1, rows, K]
boxes (a ``.mT`` view described as stored and transposed in-kernel), the same fp32
accumulation in K steps of ``chunk`` and the same epilogue as the pointer kernel (which
also folds in the normalization's scale, ``HAS_SCALE``).
"""

from __future__ import annotations

from ._launch import Config, Memo, cdiv
from ._tma import (
    descriptor_template,
    from_template,
    persistent_grid,
    persistent_options,
    tma_layout,
)
from ._triton import tl, triton
from .normalize import NormScale, inverse_norm, scale_kernel_args


@triton.jit
def _lower_tile(i_t):
    """Triangular index -> tile (i, j) with j <= i: i = floor((sqrt(8 t + 1) - 1) / 2), then
    one step either way in case the float square root rounded across an integer."""
    i = ((tl.sqrt(8.0 * i_t + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where(i * (i + 1) // 2 > i_t, i - 1, i)
    i = tl.where((i + 1) * (i + 2) // 2 <= i_t, i + 1, i)
    return i, i_t - i * (i + 1) // 2


@triton.jit
def _epilogue(
    b_acc,  # [BLOCK, BLOCK] fp32: x w^T of tile (i, j) of matrix i_b (int64)
    i_b,
    i,
    j,
    y,
    out,
    M,
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
    SYMMETRIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    BRANCHLESS: tl.constexpr,  # the mirrored store masked off on diagonal tiles, not skipped
):
    """alpha acc + beta y + diag I (alpha s^2 acc with HAS_SCALE), one rounding, stored at
    (i, j) and mirrored at (j, i)."""
    r_i = i * BLOCK + tl.arange(0, BLOCK)
    r_j = j * BLOCK + tl.arange(0, BLOCK)
    mask = (r_i[:, None] < M) & (r_j[None, :] < M)
    if HAS_SCALE:  # the normalization folded in: (s x)(s w)^T = s^2 x w^T, in fp32
        # Twice by s, not once by s^2: s is at most 1 / eps, and s^2 overflows for eps under
        # 5e-20, where a zero matrix (a padding one, an unused expert's) would give 0 inf.
        s = inverse_norm(sumsq, i_b, norm_scale, eps_ptr, True)
        b_acc *= alpha * s
        b_acc *= s
    else:
        b_acc *= alpha
    if HAS_Y:
        p_y = y + i_b * stride_yb + r_i[:, None] * stride_ym + r_j[None, :] * stride_yn
        b_acc += beta * tl.load(p_y, mask=mask, other=0.0).to(tl.float32)
    if HAS_DIAG:  # true only on the diagonal tiles' diagonals
        b_acc += tl.where(r_i[:, None] == r_j[None, :], diag, 0.0)
    if SYMMETRIZE:  # noqa: SIM102 (a constexpr and a runtime test: two ifs for Triton)
        # x_r . w_c and x_c . w_r round differently when w is not x: without this the
        # asymmetry compounds through products that read only the lower tiles.
        if i == j:
            b_acc = tl.where(r_i[:, None] >= r_j[None, :], b_acc, tl.trans(b_acc))
    b_c = b_acc.to(out.dtype.element_ty)
    out += i_b * stride_ob
    tl.store(out + r_i[:, None] * stride_om + r_j[None, :] * stride_on, b_c, mask=mask)
    p_t = out + r_j[:, None] * stride_om + r_i[None, :] * stride_on
    mask_t = (r_j[:, None] < M) & (r_i[None, :] < M)
    if BRANCHLESS:  # triton 3.6 fails to flatten a loop holding this if (a masked store)
        tl.store(p_t, tl.trans(b_c), mask=mask_t & (i != j))
    elif i != j:
        tl.store(p_t, tl.trans(b_c), mask=mask_t)


@triton.jit(do_not_specialize=("items",))
def _sym_gram_tma_kernel(
    x_desc,  # [B, M, K] box [1, BLOCK, BLOCK_K]; X_T: x.mT [B, K, M] box [1, BLOCK_K, BLOCK]
    w_desc,  # the second factor likewise (W_T)
    y,  # [B, M, M], read only when HAS_Y
    out,  # [B, M, M]
    items,  # batch x lower tiles
    M,
    K,
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
    HAS_SCALE: tl.constexpr,
    SYMMETRIZE: tl.constexpr,
    X_T: tl.constexpr,
    W_T: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """The pointer kernel's sums and epilogue, persistent, its operands read by TMA: a loop
    over (matrix, lower tile) items, matrix-major so that programs running together share
    a matrix. TMA fills rows and columns past the end with zeros (no masks on loads)."""
    tiles_side = tl.cdiv(M, BLOCK)
    tiles = tiles_side * (tiles_side + 1) // 2
    for item in tl.range(
        tl.program_id(0),
        items,
        tl.num_programs(0),
        flatten=FLATTEN,
        warp_specialize=WARP_SPECIALIZE,
    ):
        i_b = item // tiles
        i, j = _lower_tile(item % tiles)
        b_acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
            if X_T:
                b_a = x_desc.load([i_b, k * BLOCK_K, i * BLOCK]).reshape(BLOCK_K, BLOCK).T
            else:
                b_a = x_desc.load([i_b, i * BLOCK, k * BLOCK_K]).reshape(BLOCK, BLOCK_K)
            if W_T:  # already w^T: [BLOCK_K, BLOCK]
                b_bt = w_desc.load([i_b, k * BLOCK_K, j * BLOCK]).reshape(BLOCK_K, BLOCK)
            else:
                b_bt = w_desc.load([i_b, j * BLOCK, k * BLOCK_K]).reshape(BLOCK, BLOCK_K).T
            b_acc = tl.dot(b_a, b_bt, b_acc)
        _epilogue(
            b_acc, i_b.to(tl.int64), i, j, y, out, M, stride_yb, stride_ym, stride_yn,
            stride_ob, stride_om, stride_on, alpha, beta, diag, sumsq, norm_scale, eps_ptr,
            HAS_Y, HAS_DIAG, HAS_SCALE, SYMMETRIZE, BLOCK, FLATTEN,
        )  # fmt: skip


# What a TMA launch derives from its config and operands' layouts (_tma_plan), by them.
_PLANS = Memo()


def _launch_tma(
    x, w, y, out, alpha, beta, diag, symmetrize: bool, config: Config, scale: NormScale | None
) -> None:
    """``_launch`` on the persistent TMA kernel (x and w: ``tma_layout`` not None)."""
    key = (id(config), x.shape, x.stride(), x.dtype, x.data_ptr() % 16, x.device, w is x)
    key += () if w is x else (w.stride(), w.data_ptr() % 16)
    plan = _PLANS.get(key)
    if plan is None or plan[0] is not config:  # (the config held: its id names it)
        plan = _PLANS.put(key, _tma_plan(x, w, config))
    _, x_t, x_template, w_t, w_template, grid, items, options = plan
    x_desc = from_template(x_template, x.mT if x_t else x)
    w_desc = x_desc if w is x else from_template(w_template, w.mT if w_t else w)
    y_arg, args, constexprs = epilogue_args(y, out, alpha, beta, diag, symmetrize, scale)
    _, m, k = x.shape
    _sym_gram_tma_kernel[grid](
        x_desc, w_desc, y_arg, out, items, m, k, *args, **constexprs, **options
    )


def _tma_plan(x, w, config: Config) -> tuple:
    """(config, x's layout and descriptor template, w's, grid, items, launch keywords)."""
    batch, m, _ = x.shape
    tiles_side = cdiv(m, config.block)
    items = batch * tiles_side * (tiles_side + 1) // 2
    x_t, w_t = tma_layout(x), tma_layout(w)
    box = (config.block, config.chunk)
    x_template = descriptor_template(x, x_t, box[::-1] if x_t else box)
    w_template = descriptor_template(w, w_t, box[::-1] if w_t else box)
    options = dict(
        X_T=x_t,
        W_T=w_t,
        BLOCK=config.block,
        BLOCK_K=config.chunk,
        **persistent_options(config),
    )
    grid = (persistent_grid(items, config, x.device),)
    return config, x_t, x_template, w_t, w_template, grid, items, options


def epilogue_args(y, out, alpha, beta, diag, symmetrize: bool, scale: NormScale | None):
    """``_epilogue``'s launch arguments, the same for both kernels: y's argument (out in its
    place when there is no y, never read), the runtime ones from y's strides to eps (in the
    kernels' order) and the constexprs."""
    y_arg = y if y is not None else out
    sumsq, norm_scale, eps = scale_kernel_args(scale, out)
    args = (*y_arg.stride(), *out.stride(), alpha, beta, diag, sumsq, norm_scale, eps)
    constexprs = dict(
        HAS_Y=y is not None,
        HAS_DIAG=diag != 0.0,
        HAS_SCALE=scale is not None,
        SYMMETRIZE=symmetrize,
    )
    return y_arg, args, constexprs
