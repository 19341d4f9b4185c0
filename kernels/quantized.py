"""8-bit optimizer state: the quantization scheme, fused AdamW / Lion / Muon-prep kernels that
read and write it, and the torch references they are tested against.

Format. A quantized state tensor is one code a element (``CODE_DTYPES[kind]``: int8, or uint8
for the variance) and one fp32 scale a block of ``QBLOCK`` consecutive elements: the block's
largest magnitude (absmax). Element-wise state counts blocks from the parameter's first
element (a segment starts on a block boundary; its last block may be partial); Muon's momentum
counts them over each matrix's own elements, so no result depends on how matrices are batched.

Maps (``MAPS``): value = scale * sign(c) * (|c| / cmax)^power, encoded in closed form with
correctly rounded square roots, so kernels and references agree bit for bit:
  momentum (Muon, Lion)   int8, power 2, |c| <= 127
  adam_m                  int8, power 4, |c| <= 127
  adam_v                  uint8, power 4, c <= 255; a positive v never encodes as 0 (else
                          m / (0 + eps) explodes)
Rounding is stochastic and unbiased in value space (round up with probability equal to the
distance from the lower code, measured in values): round-to-nearest stalls EMAs whose change
per step is below half a code step (a unit whose gradient stops keeps its last momentum).
The random number is a hash of the new value's bits, its position in its block and the state
kind, so results are reproducible and independent of how the engine cuts segments.

Non-finite values: a NaN or Inf in a block makes that block's scale NaN and its codes 0; the
block then dequantizes to NaN (its parameter's elements turn NaN, as with fp32 state, a step
later for the block's other elements). Blocks never span parameters, so no other parameter's
scale is touched. The step that meets the NaN updates the parameter from the unquantized fp32
values, as the fp32 kernels do.

Choices (measured with ``bench/quantized_scheme.py``, see docs/design.md): one block of 256
for every kind; power maps rather than linear (Muon momentum error 3x lower) or bitsandbytes'
dynamic map (whose variance underflows to 0 for gradients 3.5 decades below the block's
largest, exploding m / eps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import (
    ALIGN_BYTES,
    TABLES,
    TUNER,
    Config,
    bench_ms,
    bucket,
    chunk_rows,
    dtype_name,
    scratch_like,
    triton_dtype,
)
from .elementwise import _lerp, _typed

QBLOCK = 256


@dataclass(frozen=True)
class CodeMap:
    signed: bool
    power: int  # 2 or 4: decoded with multiplications, encoded with square roots
    dtype: torch.dtype
    salt: int  # decorrelates the rounding noise of two states of one element

    @property
    def cmax(self) -> int:
        return 127 if self.signed else 255

    @property
    def inv_cmax(self) -> float:
        # fp32-exact, so the kernels (fp32 constants) and torch use the same number.
        return float(np.float32(1.0 / self.cmax))


MAPS = {
    "momentum": CodeMap(signed=True, power=2, dtype=torch.int8, salt=0x1B873593),
    "adam_m": CodeMap(signed=True, power=4, dtype=torch.int8, salt=0x1B873593),
    "adam_v": CodeMap(signed=False, power=4, dtype=torch.uint8, salt=0x68E31DA4),
}
CODE_DTYPES = {kind: m.dtype for kind, m in MAPS.items()}

# Tile = block elements ([block / QBLOCK, QBLOCK] as a 2-D tile), chunk elements a program;
# both multiples of QBLOCK. Candidates around the fp32 kernels' measured best (elementwise.py).
CONFIGS = (
    Config(block=2048, chunk=16384, num_warps=8),
    Config(block=1024, chunk=16384, num_warps=4),
    Config(block=4096, chunk=16384, num_warps=8),
    Config(block=2048, chunk=65536, num_warps=8),
    Config(block=1024, chunk=4096, num_warps=4),
)
PREP_CONFIGS = (
    Config(block=2048, chunk=32768, num_warps=8),
    Config(block=1024, chunk=16384, num_warps=4),
    Config(block=4096, chunk=32768, num_warps=8),
    Config(block=2048, chunk=8192, num_warps=8),
)
# Two blocks a tile, two tiles a program: small tests cover full tiles, the masked tail and
# several programs.
INTERPRETER_CONFIG = Config(block=2 * QBLOCK, chunk=4 * QBLOCK, num_warps=4)
PREP_INTERPRETER_CONFIG = INTERPRETER_CONFIG
SUM_BLOCK = 64  # partial sums a step of the final per-matrix sum (fixed: fixes its order)


# ----------------------------------------------------------------------------- Triton


_QB = tl.constexpr(QBLOCK)
# The maps' constants for the kernels (fp32-exact reciprocals, see CodeMap.inv_cmax).
_INV127 = tl.constexpr(MAPS["momentum"].inv_cmax)
_INV255 = tl.constexpr(MAPS["adam_v"].inv_cmax)
_SALT_M = tl.constexpr(MAPS["adam_m"].salt)
_SALT_V = tl.constexpr(MAPS["adam_v"].salt)


@triton.jit
def _block_tile(start, BLOCK: tl.constexpr):
    """A tile of BLOCK elements from ``start`` as [BLOCK / QBLOCK, QBLOCK]: element offsets,
    block indices and column in the block. (Its masks are made by the caller: a jit function
    cannot return None for the unmasked tiles.)"""
    NB: tl.constexpr = BLOCK // _QB
    i_b = start // _QB + tl.arange(0, NB)
    col = tl.arange(0, _QB)
    offs = start + tl.arange(0, NB)[:, None] * _QB + col[None, :]
    return offs, i_b, col


@triton.jit
def _ld(ptr, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr, mask=mask, other=0)
    return tl.load(ptr)


@triton.jit
def _hash_uniform(x, col, SALT: tl.constexpr):
    # lowbias32 (C. Wellons) of the value's bits and its column in the block: uniform in
    # [0, 1) with 24 bits, the same on every backend (torch twin: _hash_uniform_ref).
    h = x.to(tl.uint32, bitcast=True) ^ (col.to(tl.uint32) * 0x9E3779B9) ^ SALT
    h ^= h >> 16
    h *= 0x7FEB352D
    h ^= h >> 15
    h *= 0x846CA68B
    h ^= h >> 16
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _power(r, POWER: tl.constexpr):
    r2 = r * r
    if POWER == 4:
        r2 = r2 * r2
    return r2


@triton.jit
def _decode(codes, scales, POWER: tl.constexpr, INV_CMAX: tl.constexpr):
    """codes [NB, QBLOCK], scales [NB] -> fp32 values."""
    c = codes.to(tl.float32)
    mag = _power(tl.abs(c) * INV_CMAX, POWER)
    return tl.where(c < 0, -mag, mag) * scales[:, None]


@triton.jit
def _encode(
    x,
    col,
    POWER: tl.constexpr,
    CMAX: tl.constexpr,
    INV_CMAX: tl.constexpr,
    SIGNED: tl.constexpr,
    SALT: tl.constexpr,
    CODE: tl.constexpr,
):
    """x [NB, QBLOCK] fp32 (masked-out elements 0) -> codes, scales [NB]."""
    a = tl.abs(x)
    bad = (a != a) | (a == float("inf"))
    absmax = tl.max(tl.where(bad, 0.0, a), axis=1)
    poisoned = tl.max(bad.to(tl.int32), axis=1) > 0
    scales = tl.where(poisoned, float("nan"), absmax)
    y = tl.div_rn(a, tl.where(absmax > 0, absmax, 1.0)[:, None])  # in [0, 1]
    r = tl.sqrt_rn(y)
    if POWER == 4:
        r = tl.sqrt_rn(r)
    c = tl.minimum(tl.floor(r * CMAX), CMAX)
    lo = _power(c * INV_CMAX, POWER)
    hi = _power((c + 1.0) * INV_CMAX, POWER)
    u = _hash_uniform(x, col, SALT)
    c = tl.where(y - lo > u * (hi - lo), c + 1.0, c)  # up with probability (y - lo) / (hi - lo)
    if not SIGNED:
        c = tl.where(a > 0, tl.maximum(c, 1.0), c)
    c = tl.where(poisoned[:, None] | bad, 0.0, c)
    c = tl.where(x < 0, -c, c)
    return c.to(CODE), scales


@triton.jit
def _adamw8_tile(
    p_ptr,
    g_ptr,
    mc_ptr,
    ms_ptr,
    vc_ptr,
    vs_ptr,
    start,
    count,
    w1,
    beta2,
    omb2,
    eps,
    decay,
    step_size,
    bc2_sqrt,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    offs, i_b, col = _block_tile(start, BLOCK)
    mask = offs < count if MASKED else None
    bmask = i_b * _QB < count if MASKED else None
    p = _ld(p_ptr + offs, mask, MASKED).to(tl.float32)
    g = _ld(g_ptr + offs, mask, MASKED).to(tl.float32)
    m = _decode(
        _ld(mc_ptr + offs, mask, MASKED),
        _ld(ms_ptr + i_b, bmask, MASKED),
        4,
        _INV127,
    )
    v = _decode(
        _ld(vc_ptr + offs, mask, MASKED),
        _ld(vs_ptr + i_b, bmask, MASKED),
        4,
        _INV255,
    )
    m = _lerp(m, g, w1)
    v = v * beta2 + (g * g) * omb2
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p * decay - step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    codes, scales = _encode(m, col, 4, 127, _INV127, True, _SALT_M, tl.int8)
    tl.store(mc_ptr + offs, codes, mask=mask)
    tl.store(ms_ptr + i_b, scales, mask=bmask)
    codes, scales = _encode(v, col, 4, 255, _INV255, False, _SALT_V, tl.uint8)
    tl.store(vc_ptr + offs, codes, mask=mask)
    tl.store(vs_ptr + i_b, scales, mask=bmask)


@triton.jit
def _adamw8_kernel(
    table,  # [programs, 8] int64: p, g, m codes, m scales, v codes, v scales, start, count
    w1,  # 1 - beta1 (lerp weight)
    beta2,
    omb2,  # 1 - beta2
    eps,
    decay,  # 1 - lr * weight_decay
    step_size,  # lr / (1 - beta1^step)
    bc2_sqrt,  # sqrt(1 - beta2^step)
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    i_p = tl.program_id(0).to(tl.int64)
    row = table + i_p * 8
    start = tl.load(row + 6)  # a multiple of the chunk, so of QBLOCK
    count = tl.load(row + 7)
    p_ptr = _typed(row, 0, P_DTYPE, start, ALIGNED)
    g_ptr = _typed(row, 1, G_DTYPE, start, ALIGNED)
    mc_ptr = _typed(row, 2, tl.int8, start, ALIGNED)
    ms_ptr = _typed(row, 3, tl.float32, start // _QB, False)
    vc_ptr = _typed(row, 4, tl.uint8, start, ALIGNED)
    vs_ptr = _typed(row, 5, tl.float32, start // _QB, False)
    n_full = count // BLOCK
    for i_t in range(n_full):  # full tiles: no mask, so accesses stay 16 bytes wide
        _adamw8_tile(
            p_ptr,
            g_ptr,
            mc_ptr,
            ms_ptr,
            vc_ptr,
            vs_ptr,
            i_t * BLOCK,
            count,
            w1,
            beta2,
            omb2,
            eps,
            decay,
            step_size,
            bc2_sqrt,
            BLOCK,
            False,
        )
    if n_full * BLOCK < count:
        _adamw8_tile(
            p_ptr,
            g_ptr,
            mc_ptr,
            ms_ptr,
            vc_ptr,
            vs_ptr,
            n_full * BLOCK,
            count,
            w1,
            beta2,
            omb2,
            eps,
            decay,
            step_size,
            bc2_sqrt,
            BLOCK,
            True,
        )


@triton.jit
def _lion8_tile(
    p_ptr,
    g_ptr,
    mc_ptr,
    ms_ptr,
    start,
    count,
    w1,
    w2,
    decay,
    lr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    offs, i_b, col = _block_tile(start, BLOCK)
    mask = offs < count if MASKED else None
    bmask = i_b * _QB < count if MASKED else None
    p = _ld(p_ptr + offs, mask, MASKED).to(tl.float32)
    g = _ld(g_ptr + offs, mask, MASKED).to(tl.float32)
    m = _decode(
        _ld(mc_ptr + offs, mask, MASKED),
        _ld(ms_ptr + i_b, bmask, MASKED),
        2,
        _INV127,
    )
    u = _lerp(m, g, w1)
    sign = tl.where(u > 0, 1.0, tl.where(u < 0, -1.0, 0.0))
    sign = tl.where(u != u, u, sign)  # NaN stays NaN, as torch.sign
    m = _lerp(m, g, w2)
    p = p * decay - lr * sign
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    codes, scales = _encode(m, col, 2, 127, _INV127, True, _SALT_M, tl.int8)
    tl.store(mc_ptr + offs, codes, mask=mask)
    tl.store(ms_ptr + i_b, scales, mask=bmask)


@triton.jit
def _lion8_kernel(
    table,  # [programs, 6] int64: p, g, m codes, m scales, start, count
    w1,  # 1 - beta1
    w2,  # 1 - beta2
    decay,  # 1 - lr * weight_decay
    lr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    i_p = tl.program_id(0).to(tl.int64)
    row = table + i_p * 6
    start = tl.load(row + 4)
    count = tl.load(row + 5)
    p_ptr = _typed(row, 0, P_DTYPE, start, ALIGNED)
    g_ptr = _typed(row, 1, G_DTYPE, start, ALIGNED)
    mc_ptr = _typed(row, 2, tl.int8, start, ALIGNED)
    ms_ptr = _typed(row, 3, tl.float32, start // _QB, False)
    n_full = count // BLOCK
    for i_t in range(n_full):
        _lion8_tile(
            p_ptr, g_ptr, mc_ptr, ms_ptr, i_t * BLOCK, count, w1, w2, decay, lr, BLOCK, False
        )
    if n_full * BLOCK < count:
        _lion8_tile(
            p_ptr, g_ptr, mc_ptr, ms_ptr, n_full * BLOCK, count, w1, w2, decay, lr, BLOCK, True
        )


@triton.jit
def _prep8_tile(
    mc_ptr,
    ms_ptr,
    g_ptr,
    u_ptr,
    mu,
    start,
    count,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    NESTEROV: tl.constexpr,
):
    """Returns the tile's sums of squares of the stored update a block (masked elements: 0)."""
    offs, i_b, col = _block_tile(start, BLOCK)
    mask = offs < count if MASKED else None
    bmask = i_b * _QB < count if MASKED else None
    g = _ld(g_ptr + offs, mask, MASKED).to(tl.float32)
    m = _decode(
        _ld(mc_ptr + offs, mask, MASKED),
        _ld(ms_ptr + i_b, bmask, MASKED),
        2,
        _INV127,
    )
    m = m * mu + g
    u = m * mu + g if NESTEROV else m
    u = u.to(u_ptr.dtype.element_ty)
    tl.store(u_ptr + offs, u, mask=mask)
    codes, scales = _encode(m, col, 2, 127, _INV127, True, _SALT_M, tl.int8)
    tl.store(mc_ptr + offs, codes, mask=mask)
    tl.store(ms_ptr + i_b, scales, mask=bmask)
    u = u.to(tl.float32)
    return tl.sum(u * u, axis=1)  # masked elements are 0


@triton.jit
def _prep8_kernel(
    table,  # [B, 3] int64: momentum codes, momentum scales, gradient addresses
    out,  # [B, numel] update, contiguous
    partial,  # [B, chunks] fp32 partial sums of squares
    numel,  # elements per matrix
    chunks,  # programs per matrix
    mu,
    G_DTYPE: tl.constexpr,
    NESTEROV: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_m = tl.program_id(1).to(tl.int64)
    row = table + i_m * 3
    start = i_c * CHUNK
    mc_ptr = _typed(row, 0, tl.int8, start, ALIGNED)
    ms_ptr = _typed(row, 1, tl.float32, start // _QB, False)
    g_ptr = _typed(row, 2, G_DTYPE, start, ALIGNED)
    u_ptr = out + i_m * numel + start
    count = tl.minimum(numel - start, CHUNK)
    acc = tl.zeros([BLOCK // _QB], dtype=tl.float32)
    n_full = count // BLOCK
    for i_t in range(n_full):
        acc += _prep8_tile(
            mc_ptr, ms_ptr, g_ptr, u_ptr, mu, i_t * BLOCK, count, BLOCK, False, NESTEROV
        )
    if n_full * BLOCK < count:
        acc += _prep8_tile(
            mc_ptr, ms_ptr, g_ptr, u_ptr, mu, n_full * BLOCK, count, BLOCK, True, NESTEROV
        )
    tl.store(partial + i_m * chunks + i_c, tl.sum(acc, axis=0))


@triton.jit
def _row_sum_kernel(partial, out, chunks, BLOCK: tl.constexpr):
    # One program a matrix, one fixed order: the sum depends on the matrix's chunk count
    # only, never on how many matrices share the launch.
    i_m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, chunks, BLOCK):
        acc += tl.load(partial + i_m * chunks + i + offs, mask=i + offs < chunks, other=0.0)
    tl.store(out + i_m, tl.sum(acc, axis=0))


# ----------------------------------------------------------------------------- launchers


def _check_segments(params, grads, codes_scales) -> list[int]:
    """params, grads and each codes list: same element counts, contiguous, one device; each
    scales list: fp32 with one entry a block of its segment."""
    numels = [t.numel() for t in params]
    device = params[0].device if params else None
    lists = [("params", params), ("grads", grads)]
    lists += [(name, codes) for name, codes, _, _ in codes_scales]
    for name, tensors in lists:
        if len(tensors) != len(numels) or [t.numel() for t in tensors] != numels:
            raise ValueError(f"{name}: segment count or element counts differ from params'")
        for t in tensors:
            if not t.is_contiguous() or t.device != device:
                raise ValueError(f"{name}: every tensor must be contiguous and on {device}")
    for name, codes, scales, kind in codes_scales:
        for i, (c, s) in enumerate(zip(codes, scales, strict=True)):
            if c.dtype != CODE_DTYPES[kind]:
                raise ValueError(f"{name}[{i}] is {c.dtype}, expected {CODE_DTYPES[kind]}")
            if s.dtype != torch.float32 or s.numel() != -(-c.numel() // QBLOCK):
                raise ValueError(
                    f"{name} scales[{i}]: {s.numel()} {s.dtype}, expected "
                    f"{-(-c.numel() // QBLOCK)} float32 (one a block of {QBLOCK})"
                )
            if not s.is_contiguous() or s.device != device:
                raise ValueError(f"{name} scales[{i}] must be contiguous and on {device}")
    return numels


def _launch_elementwise(kernel, name, lists, numels, scalars) -> None:
    """One launch per (param dtype, grad dtype, 16-byte alignment) group of segments.
    ``lists``: params, grads, then codes and scales per state. Scales need 4-byte alignment
    only; the others are read 16 bytes at a time when aligned."""
    if not numels:
        return
    device = lists[0][0].device
    groups: dict[tuple, list[int]] = {}
    for i in range(len(numels)):
        aligned = all(
            lists[j][i].data_ptr() % ALIGN_BYTES == 0
            for j in range(len(lists))
            if j < 2 or j % 2 == 0
        )
        groups.setdefault((lists[0][i].dtype, lists[1][i].dtype, aligned), []).append(i)
    for (p_dtype, g_dtype, aligned), index in groups.items():
        ptrs = tuple(tuple(lists[j][i].data_ptr() for i in index) for j in range(len(lists)))
        sizes = tuple(numels[i] for i in index)
        dtypes = (triton_dtype(p_dtype), triton_dtype(g_dtype))

        def launch(ptrs, config, aligned=aligned, sizes=sizes, dtypes=dtypes):
            key = (name, device.index, config.chunk, ptrs, sizes)
            table = TABLES.get(
                key,
                lambda: chunk_rows(
                    np.array(ptrs, dtype=np.int64).T.reshape(len(sizes), len(ptrs)),
                    np.array(sizes, dtype=np.int64),
                    config.chunk,
                ),
                device,
            )
            kernel[(table.shape[0],)](
                table,
                *scalars,
                *dtypes,
                BLOCK=config.block,
                ALIGNED=aligned,
                num_warps=config.num_warps,
                # Products rounded before sums, as the torch reference: codes match it bit
                # for bit on the GPU too (a fused multiply-add can move a rounding).
                enable_fp_fusion=False,
            )

        def bench(config, index=index, launch=launch):
            scratch = []
            for j, tensors in enumerate(lists):
                group = [tensors[i] for i in index]
                if j >= 2 and j % 2 == 0:  # codes: random bytes
                    scratch.append([torch.randint_like(t, 0, 100) for t in group])
                elif j >= 2:  # scales
                    scratch.append(scratch_like(group, positive=True))
                else:
                    scratch.append(scratch_like(group))
            ptrs = tuple(tuple(t.data_ptr() for t in col) for col in scratch)
            return bench_ms(lambda: launch(ptrs, config))

        key = (dtype_name(p_dtype), dtype_name(g_dtype), bucket(sum(sizes)), bucket(len(sizes)))
        config = TUNER.choose(name, key, CONFIGS, INTERPRETER_CONFIG, device, bench)
        launch(ptrs, config)


def _adamw_scalars(lr, beta1, beta2, eps, weight_decay, step) -> tuple[float, ...]:
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    return (
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        eps,
        1.0 - lr * weight_decay,
        lr / (1.0 - beta1**step),
        math.sqrt(1.0 - beta2**step),
    )


def adamw8_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    m_codes: Sequence[Tensor],
    m_scales: Sequence[Tensor],
    v_codes: Sequence[Tensor],
    v_scales: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """Fused AdamW on 8-bit state (``adam_m`` / ``adam_v`` maps), any number of segments;
    same math as ``adamw8_reference_``. Each segment starts on a block boundary of its
    parameter; its scales hold ceil(numel / QBLOCK) entries."""
    scalars = _adamw_scalars(lr, beta1, beta2, eps, weight_decay, step)
    numels = _check_segments(
        params,
        grads,
        [("m_codes", m_codes, m_scales, "adam_m"), ("v_codes", v_codes, v_scales, "adam_v")],
    )
    lists = (params, grads, m_codes, m_scales, v_codes, v_scales)
    _launch_elementwise(_adamw8_kernel, "adamw8", lists, numels, scalars)


def lion8_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    m_codes: Sequence[Tensor],
    m_scales: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Fused Lion on 8-bit momentum (``momentum`` map); same math as ``lion8_reference_``."""
    numels = _check_segments(params, grads, [("m_codes", m_codes, m_scales, "momentum")])
    scalars = (1.0 - beta1, 1.0 - beta2, 1.0 - lr * weight_decay, lr)
    _launch_elementwise(_lion8_kernel, "lion8", (params, grads, m_codes, m_scales), numels, scalars)


def _prep8_launch(m_codes, m_scales, grads, mu, nesterov, out, partial, config) -> None:
    batch, numel = len(m_codes), m_codes[0].numel()
    chunks = partial.shape[1]
    lists = (m_codes, m_scales, grads)
    ptrs = tuple(tuple(t.data_ptr() for t in ts) for ts in zip(*lists, strict=True))
    device = grads[0].device
    table = TABLES.get(("muon_prep8", device, ptrs), lambda: np.array(ptrs, np.int64), device)
    aligned = all(p[0] % ALIGN_BYTES == 0 and p[2] % ALIGN_BYTES == 0 for p in ptrs)
    _prep8_kernel[(chunks, batch)](
        table,
        out,
        partial,
        numel,
        chunks,
        mu,
        triton_dtype(grads[0].dtype),
        NESTEROV=nesterov,
        CHUNK=config.chunk,
        BLOCK=config.block,
        ALIGNED=aligned,
        num_warps=config.num_warps,
        enable_fp_fusion=False,
    )


def muon_prep8(
    m_codes: Sequence[Tensor],
    m_scales: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    mu: float,
    nesterov: bool,
    out: Tensor | None = None,
    sumsq: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``muon_prep`` on 8-bit momentum: M = mu M + G (requantized in place), U = mu M + G
    with nesterov else M, stored in ``out`` (bf16 [B, m, n] by default), and each matrix's
    sum of squares of the stored U. ``m_codes[i]`` is int8 with the matrix's shape,
    ``m_scales[i]`` fp32 [ceil(m n / QBLOCK)]. The sum's order depends on the matrix shape
    only (the config is chosen by shape, the final sum is one fixed-order program a matrix):
    a matrix gives the same bits in a batch of 1 or 40."""
    if not m_codes:
        raise ValueError("empty batch")
    shape, numel = m_codes[0].shape, m_codes[0].numel()
    batch = len(m_codes)
    _check_segments(m_codes, grads, [("m_codes", m_codes, m_scales, "momentum")])
    if any(g.shape != shape or g.dtype != grads[0].dtype for g in grads):
        raise ValueError(f"grads must all be {grads[0].dtype} of shape {tuple(shape)}")
    device = grads[0].device
    if out is None:
        out = torch.empty((batch, *shape), dtype=torch.bfloat16, device=device)
    if sumsq is None:
        sumsq = torch.empty(batch, dtype=torch.float32, device=device)
    if out.numel() != batch * numel or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous [{batch}, *{tuple(shape)}] tensor on {device}")
    if sumsq.shape != (batch,) or sumsq.dtype != torch.float32:
        raise ValueError(f"sumsq must be fp32 of shape [{batch}]")
    if numel == 0:
        sumsq.zero_()
        return out, sumsq
    # No batch in the key: a shape gets one config whatever the batch, so its sums of
    # squares are summed in one order.
    key = (dtype_name(grads[0].dtype), dtype_name(out.dtype), tuple(shape), bool(nesterov))

    def bench(config: Config) -> float:
        codes = [torch.randint_like(c, -100, 100) for c in m_codes]
        scales = scratch_like(m_scales, positive=True)
        g = scratch_like(grads)
        part = torch.empty(batch, triton.cdiv(numel, config.chunk), device=device)
        scratch_out = torch.empty_like(out)
        return bench_ms(
            lambda: _prep8_launch(codes, scales, g, mu, nesterov, scratch_out, part, config)
        )

    config = TUNER.choose("muon_prep8", key, PREP_CONFIGS, PREP_INTERPRETER_CONFIG, device, bench)
    partial = torch.empty(batch, triton.cdiv(numel, config.chunk), device=device)
    _prep8_launch(m_codes, m_scales, grads, float(mu), bool(nesterov), out, partial, config)
    _row_sum_kernel[(batch,)](partial, sumsq, partial.shape[1], BLOCK=SUM_BLOCK)
    return out, sumsq


# ----------------------------------------------------------------------------- torch


def _hash_uniform_ref(x: Tensor, col: Tensor, salt: int) -> Tensor:
    """``_hash_uniform`` in int64 arithmetic, masked to 32 bits."""
    mask = 0xFFFFFFFF

    def mul(h: Tensor, k: int) -> Tensor:  # (h * k) mod 2^32 without int64 overflow
        return (h * (k & 0xFFFF) + ((h * (k >> 16)) & 0xFFFF) * 65536) & mask

    h = x.view(torch.int32).to(torch.int64) & mask
    h = h ^ mul(col.to(torch.int64), 0x9E3779B9) ^ salt
    h = h ^ (h >> 16)
    h = mul(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = mul(h, 0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * 5.9604644775390625e-08


def _power_ref(r: Tensor, power: int) -> Tensor:
    r2 = r * r
    return r2 * r2 if power == 4 else r2


def _blocks(x: Tensor) -> tuple[Tensor, int]:
    """Flat x padded with zeros to whole blocks, as [blocks, QBLOCK]; and the pad."""
    flat = x.reshape(-1)
    pad = -flat.numel() % QBLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, QBLOCK), pad


def _decode_ref(codes: Tensor, scales: Tensor, cmap: CodeMap) -> Tensor:
    cb, pad = _blocks(codes.to(torch.float32))
    mag = _power_ref(cb.abs() * cmap.inv_cmax, cmap.power)
    x = torch.where(cb < 0, -mag, mag) * scales.reshape(-1, 1)
    return x.reshape(-1)[: codes.numel()].view(codes.shape)


def _encode_ref(x: Tensor, cmap: CodeMap) -> tuple[Tensor, Tensor]:
    xb, pad = _blocks(x.to(torch.float32))
    a = xb.abs()
    bad = ~torch.isfinite(a)
    absmax = torch.where(bad, 0.0, a).amax(dim=1)
    poisoned = bad.any(dim=1)
    scales = torch.where(poisoned, torch.nan, absmax)
    y = a / torch.where(absmax > 0, absmax, 1.0)[:, None]
    r = y.sqrt()
    if cmap.power == 4:
        r = r.sqrt()
    c = (r * cmap.cmax).floor().clamp_max(cmap.cmax)
    lo = _power_ref(c * cmap.inv_cmax, cmap.power)
    hi = _power_ref((c + 1.0) * cmap.inv_cmax, cmap.power)
    col = torch.arange(QBLOCK, device=x.device).expand_as(xb)
    u = _hash_uniform_ref(xb, col, cmap.salt)
    c = torch.where(y - lo > u * (hi - lo), c + 1.0, c)
    if not cmap.signed:
        c = torch.where(a > 0, c.clamp_min(1.0), c)
    c = torch.where(poisoned[:, None] | bad, 0.0, c)
    c = torch.where(xb < 0, -c, c)
    codes = c.reshape(-1)[: x.numel()].to(cmap.dtype).view(x.shape)
    return codes, scales


def quantize(x: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """Dense state -> (codes shaped as x, fp32 scales [ceil(numel / QBLOCK)]), blocks over x's
    flattened elements. The kernels' encoding exactly (same rounding noise)."""
    return _encode_ref(x, MAPS[kind])


def dequantize(codes: Tensor, scales: Tensor, kind: str) -> Tensor:
    """(codes, scales) -> float32 state shaped as codes; the inverse of ``quantize``."""
    if scales.numel() != -(-codes.numel() // QBLOCK):
        raise ValueError(f"{codes.numel()} codes need {-(-codes.numel() // QBLOCK)} scales")
    return _decode_ref(codes, scales.float(), MAPS[kind])


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
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """AdamW (``adamw_reference_``'s math) on dequantized state, requantized after."""
    w1, beta2, omb2, eps, decay, step_size, bc2_sqrt = _adamw_scalars(
        lr, beta1, beta2, eps, weight_decay, step
    )
    for p, g, mc, ms, vc, vs in zip(
        params, grads, m_codes, m_scales, v_codes, v_scales, strict=True
    ):
        g32 = g.float()
        m = _lerp_ref(_decode_ref(mc, ms, MAPS["adam_m"]), g32, w1)
        v = _decode_ref(vc, vs, MAPS["adam_v"]) * beta2 + (g32 * g32) * omb2
        # A tensor divisor: torch turns division by a Python scalar into a multiplication by
        # its reciprocal (another rounding than the kernel's division).
        denom = v.sqrt() / torch.full_like(v, bc2_sqrt) + eps
        p.copy_(p.float() * decay - step_size * (m / denom))
        for codes, scales, x, kind in ((mc, ms, m, "adam_m"), (vc, vs, v, "adam_v")):
            c, s = _encode_ref(x, MAPS[kind])
            codes.copy_(c)
            scales.copy_(s)


def lion8_reference_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    m_codes: Sequence[Tensor],
    m_scales: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Lion (``lion_reference_``'s math) on dequantized momentum, requantized after."""
    for p, g, mc, ms in zip(params, grads, m_codes, m_scales, strict=True):
        g32 = g.float()
        m = _decode_ref(mc, ms, MAPS["momentum"])
        update = _lerp_ref(m, g32, 1.0 - beta1).sign()
        m = _lerp_ref(m, g32, 1.0 - beta2)
        p.copy_(p.float() * (1.0 - lr * weight_decay) - lr * update)
        c, s = _encode_ref(m, MAPS["momentum"])
        mc.copy_(c)
        ms.copy_(s)


def muon_prep8_reference(
    m_codes: Sequence[Tensor],
    m_scales: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    mu: float,
    nesterov: bool,
    out: Tensor | None = None,
    sumsq: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``muon_prep_reference`` on dequantized momentum, requantized after."""
    batch, shape = len(m_codes), m_codes[0].shape
    device = grads[0].device
    if out is None:
        out = torch.empty((batch, *shape), dtype=torch.bfloat16, device=device)
    if sumsq is None:
        sumsq = torch.empty(batch, dtype=torch.float32, device=device)
    for i, (mc, ms, g) in enumerate(zip(m_codes, m_scales, grads, strict=True)):
        g32 = g.float()
        m = _decode_ref(mc, ms, MAPS["momentum"]) * mu + g32
        u = m * mu + g32 if nesterov else m
        out[i].copy_(u)
        sumsq[i] = out[i].float().square().sum()
        c, s = _encode_ref(m, MAPS["momentum"])
        mc.copy_(c)
        ms.copy_(s)
    return out, sumsq
