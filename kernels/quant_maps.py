"""8-bit optimizer state's format: the code maps, their encoding and decoding as Triton
helpers for the kernels (quantized_elementwise.py, quantized_muon.py) and as torch twins, and
``quantize`` / ``dequantize`` between dense and 8-bit state.

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

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ._tables import DTYPE, check_lists
from ._triton import tl, triton

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
def _load_state(
    c_ptr,
    s_ptr,
    offs,
    i_b,
    mask,
    bmask,
    MASKED: tl.constexpr,
    POWER: tl.constexpr,
    INV_CMAX: tl.constexpr,
):
    """A tile of an 8-bit state, decoded to fp32: codes at ``offs``, the blocks' scales at
    ``i_b`` (``_block_tile``'s)."""
    codes = _ld(c_ptr + offs, mask, MASKED)
    return _decode(codes, _ld(s_ptr + i_b, bmask, MASKED), POWER, INV_CMAX)


@triton.jit
def _store_state(
    x,
    c_ptr,
    s_ptr,
    offs,
    i_b,
    col,
    mask,
    bmask,
    POWER: tl.constexpr,
    CMAX: tl.constexpr,
    INV_CMAX: tl.constexpr,
    SIGNED: tl.constexpr,
    SALT: tl.constexpr,
):
    """``_load_state``'s inverse: x encoded (codes of c_ptr's dtype) and stored with its scales."""
    codes, scales = _encode(x, col, POWER, CMAX, INV_CMAX, SIGNED, SALT, c_ptr.dtype.element_ty)
    tl.store(c_ptr + offs, codes, mask=mask)
    tl.store(s_ptr + i_b, scales, mask=bmask)


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


def requantize_(codes: Tensor, scales: Tensor, x: Tensor, kind: str) -> None:
    """``quantize`` x into existing codes and scales: the references' store of a new state."""
    c, s = quantize(x, kind)
    codes.copy_(c)
    scales.copy_(s)


def dequantize(codes: Tensor, scales: Tensor, kind: str) -> Tensor:
    """(codes, scales) -> float32 state shaped as codes; the inverse of ``quantize``."""
    if scales.numel() != -(-codes.numel() // QBLOCK):
        raise ValueError(f"{codes.numel()} codes need {-(-codes.numel() // QBLOCK)} scales")
    return _decode_ref(codes, scales.float(), MAPS[kind])


def check_segments(params, grads, states) -> list[int]:
    """The segments' element counts, after checking them. ``states``: (name, codes, scales,
    map kind) per state. params, grads and each codes list: same element counts, contiguous,
    one device (``_tables.check_lists``); codes in the map's dtype; each scales list: fp32,
    one entry a block. ``grads`` None: gradients the launch reads through its table alone
    (``_grad_index.TabledGrads``), checked where the table was written. This runs for every
    unit of every step: the attribute reads go through ``map`` (loops in C), and only a
    failing list is walked in Python for its message."""
    lists = {"params": params, "grads": grads}
    lists.update((name, codes) for name, codes, _, _ in states if codes is not params)
    lists = {name: tensors for name, tensors in lists.items() if tensors is not None}
    numels = check_lists(tuple(lists), tuple(lists.values()))
    where = params[0].get_device() if params else None
    blocks = [-(-n // QBLOCK) for n in numels]
    for name, codes, scales, kind in states:
        dtype = CODE_DTYPES[kind]
        if len(scales) != len(codes):
            raise ValueError(f"{name}: {len(scales)} scales lists for {len(codes)} codes")
        if (
            set(map(DTYPE, codes)) == {dtype}
            and set(map(DTYPE, scales)) == {torch.float32}
            and list(map(Tensor.numel, scales)) == blocks
            and all(map(Tensor.is_contiguous, scales))
            and set(map(Tensor.get_device, scales)) == {where}
        ):
            continue  # the usual case, checked by loops in C
        for i, (c, s) in enumerate(zip(codes, scales, strict=True)):  # the first that fails
            if c.dtype != dtype:
                raise ValueError(f"{name}[{i}] is {c.dtype}, expected {dtype}")
            if s.dtype != torch.float32 or s.numel() != -(-c.numel() // QBLOCK):
                raise ValueError(
                    f"{name} scales[{i}]: {s.numel()} {s.dtype}, expected "
                    f"{-(-c.numel() // QBLOCK)} float32 (one a block of {QBLOCK})"
                )
            if not s.is_contiguous() or s.get_device() != where:
                raise ValueError(f"{name} scales[{i}] must be contiguous and on {params[0].device}")
    return numels
