"""How one parameter's state is stored: dense (one tensor a key), or block-scaled (codes and
one fp32 scale per block of ``block`` elements, a pair a key: 8-bit, ``Int8``), or any format
a ``StatePolicy`` subclass chooses (docs/design.md, "State formats").

The format owns what the rest of the engine must not guess: the tensors a key needs and their
shapes (``specs``), the bytes an element costs (for budgets), where element-wise cuts may fall
(``align``: whole blocks, so a block's scale never depends on the chunking), and how a segment
of a parameter, or some matrices of a stack, map onto each tensor (``segment``, ``matrices``).
State is allocated key by key, codes then scales, so a parameter's state stays one contiguous
host range and streams as one copy.

Blocks: element-wise state counts blocks over the parameter's flattened elements; Muon's
momentum over each matrix's own elements (``matrices`` > 1 for a stack), so a matrix's blocks
do not depend on how matrices are batched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .planner import SEGMENT_ALIGN

# Below this many elements state stays dense fp32, as bitsandbytes keeps small tensors: their
# bytes are negligible and blockwise scales would cost more than they save.
MIN_QUANTIZED_NUMEL = 4096


class StateFormat:
    """What every format declares. ``kernels``: the family of fused kernels an algorithm may
    have for it (``Algorithm.kernels``: "dense", "int8"); a format whose family the unit's
    algorithm lacks (None: no kernels of its own) steps through ``decoded.py``: decoded to fp32
    scratch, the algorithm's dense update, encoded back.

    A logical state key (``momentum``) becomes the tensors ``names(key)`` (``state_dict()``
    names them so), of the shapes and dtypes ``specs`` gives: the first of the parameter's shape
    (or its segment's, its matrices'), the others *side* tensors (``is_side``: a shape of their
    own, e.g. block scales). ``to_dense`` / ``from_dense`` convert one item's tensors of a key
    to and from fp32 (checkpoints between formats, the decoded path); ``accepts`` checks loaded
    tensors of a key (their dtypes) before anything is written."""

    kernels: str | None = None

    @property
    def align(self) -> int:
        return SEGMENT_ALIGN

    def names(self, key: str) -> tuple[str, ...]:
        return (key,)

    def is_side(self, name: str) -> bool:
        return False

    def specs(self, key: str, shape: torch.Size, kind: str, matrices: int = 1) -> list:
        raise NotImplementedError

    def nbytes(self, numel: int, nkeys: int) -> int:
        raise NotImplementedError

    def same_layout(self, other: StateFormat) -> bool:
        """Whether tensors of ``other`` copy into this format's as they are (dtype cast)."""
        return self == other

    def accepts(self, tensors: tuple[Tensor, ...], key: str, kind: str, where: str) -> None:
        """Raise ``ValueError`` if loaded ``tensors`` (of ``names(key)``) do not fit."""

    def to_dense(self, tensors: tuple[Tensor, ...], kind: str) -> Tensor:
        raise NotImplementedError

    def from_dense(self, x: Tensor, kind: str, out: tuple[Tensor, ...]) -> None:
        """Encode fp32 ``x`` into ``out`` (one item's tensors of a key), in place."""
        raise NotImplementedError

    def segment(self, name: str, t: Tensor, span: slice) -> Tensor:
        return t.view(-1)[span]

    def matrices(self, name: str, t: Tensor, piece) -> Tensor:
        """Matrices [start, stop) of a stack's state (``planner.Matrices``)."""
        return t.view(-1, *t.shape[-2:])[piece.start : piece.stop]


@dataclass(frozen=True)
class Dense(StateFormat):
    dtype: torch.dtype
    kernels = "dense"

    def specs(self, key: str, shape: torch.Size, kind: str = "", matrices: int = 1) -> list:
        return [(key, torch.Size(shape), self.dtype)]

    def nbytes(self, numel: int, nkeys: int) -> int:
        return nkeys * numel * self.dtype.itemsize

    def same_layout(self, other: StateFormat) -> bool:
        return isinstance(other, Dense)

    def to_dense(self, tensors: tuple[Tensor, ...], kind: str) -> Tensor:
        return tensors[0].float()

    def from_dense(self, x: Tensor, kind: str, out: tuple[Tensor, ...]) -> None:
        out[0].copy_(x)


@dataclass(frozen=True)
class Blockwise(StateFormat):
    """Codes (one a element, of the parameter's shape) and one fp32 scale a block of
    ``block`` elements: ``key_codes`` and ``key_scales``. A subclass gives the codes' dtype
    and bytes and the encoding of one run of blocks (``quantize`` / ``dequantize``)."""

    block: int
    code_bytes = 1

    @property
    def align(self) -> int:
        return math.lcm(SEGMENT_ALIGN, self.block)

    def names(self, key: str) -> tuple[str, ...]:
        return (f"{key}_codes", f"{key}_scales")

    def is_side(self, name: str) -> bool:
        return name.endswith("_scales")

    def code_dtype(self, kind: str) -> torch.dtype:
        raise NotImplementedError

    def quantize(self, x: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        """fp32 ``x`` -> (codes shaped as x, scales [ceil(numel / block)]), blocks over x."""
        raise NotImplementedError

    def dequantize(self, codes: Tensor, scales: Tensor, kind: str) -> Tensor:
        raise NotImplementedError

    def scales_shape(self, shape: torch.Size, matrices: int) -> torch.Size:
        numel = math.prod(shape)
        if matrices > 1:
            return torch.Size((matrices, -(-(numel // matrices) // self.block)))
        return torch.Size((-(-numel // self.block),))

    def specs(self, key: str, shape: torch.Size, kind: str, matrices: int = 1) -> list:
        codes, scales = self.names(key)
        return [
            (codes, torch.Size(shape), self.code_dtype(kind)),
            (scales, self.scales_shape(shape, matrices), torch.float32),
        ]

    def nbytes(self, numel: int, nkeys: int) -> int:
        return nkeys * (numel * self.code_bytes + 4 * -(-numel // self.block))

    def accepts(self, tensors: tuple[Tensor, ...], key: str, kind: str, where: str) -> None:
        codes, scales = tensors
        if codes.dtype != self.code_dtype(kind) or scales.dtype != torch.float32:
            raise ValueError(
                f"{where}: loaded {self.label} state {key!r} has codes {codes.dtype} and scales "
                f"{scales.dtype}; expected {self.code_dtype(kind)} codes and float32 scales"
            )

    label = "block-scaled"

    def encode(self, x: Tensor, kind: str, scales_shape: torch.Size) -> tuple[Tensor, Tensor]:
        """Dense state -> (codes, scales), block by block of each matrix (one row of
        ``scales_shape`` a matrix)."""
        rows = scales_shape[0] if len(scales_shape) == 2 else 1
        pieces = [self.quantize(m, kind) for m in x.reshape(rows, -1).float().unbind(0)]
        codes = torch.cat([c.reshape(-1) for c, _ in pieces]).reshape(x.shape)
        return codes, torch.stack([s.reshape(-1) for _, s in pieces]).reshape(scales_shape)

    def decode(self, codes: Tensor, scales: Tensor, kind: str) -> Tensor:
        """(codes, scales) -> float32 state, the inverse of ``encode``."""
        rows = scales.shape[0] if scales.ndim == 2 else 1
        flat_scales = scales.reshape(rows, -1)
        out = [
            self.dequantize(c, s, kind).reshape(-1)
            for c, s in zip(codes.reshape(rows, -1).unbind(0), flat_scales.unbind(0), strict=True)
        ]
        return torch.cat(out).reshape(codes.shape)

    def to_dense(self, tensors: tuple[Tensor, ...], kind: str) -> Tensor:
        return self.decode(*tensors, kind)

    def from_dense(self, x: Tensor, kind: str, out: tuple[Tensor, ...]) -> None:
        codes, scales = self.encode(x, kind, out[1].shape)
        out[0].copy_(codes)
        out[1].copy_(scales)

    def segment(self, name: str, t: Tensor, span: slice) -> Tensor:
        if self.is_side(name):
            # Segments start on block boundaries (align); the last may end mid-block.
            return t.view(-1)[span.start // self.block : -(-span.stop // self.block)]
        return t.view(-1)[span]

    def matrices(self, name: str, t: Tensor, piece) -> Tensor:
        """Matrices [start, stop) of a stack's state (``planner.Matrices``): their codes, and
        their rows of scales (one a matrix: a block never spans two matrices)."""
        if self.is_side(name):
            return t[piece.start : piece.stop]
        return t.view(-1, *t.shape[-2:])[piece.start : piece.stop]


@dataclass(frozen=True)
class Int8(Blockwise):
    """8-bit state (``kernels/quant_maps.py``): int8 / uint8 codes by state kind, power maps,
    stochastic rounding; the fused 8-bit kernels take it."""

    kernels = "int8"
    label = "8-bit"

    def code_dtype(self, kind: str) -> torch.dtype:
        from ..kernels import quant_maps  # imported only where 8-bit state is used

        return quant_maps.CODE_DTYPES[kind]

    def quantize(self, x: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        from ..kernels import quant_maps

        return quant_maps.quantize(x, kind)

    def dequantize(self, codes: Tensor, scales: Tensor, kind: str) -> Tensor:
        from ..kernels import quant_maps

        return quant_maps.dequantize(codes, scales, kind)


class StatePolicy:
    """Chooses each parameter's format from the optimizer's ``state_dtype``."""

    def __init__(self, state_dtype: torch.dtype | None):
        self.state_dtype = state_dtype

    def dense_dtype(self, param: Tensor) -> torch.dtype:
        # fp16 cannot hold AdamW's variance (g^2 underflows below 6e-8, updates blow up): fp16
        # parameters keep fp32 state unless a dense state_dtype is asked for. 8-bit's small
        # tensors stay fp32.
        if self.state_dtype in (torch.float32, torch.bfloat16):
            return self.state_dtype
        if self.state_dtype == torch.int8 or param.dtype == torch.float16:
            return torch.float32
        return param.dtype

    def format_for(self, param: Tensor) -> StateFormat:
        if self.state_dtype == torch.int8 and param.numel() >= MIN_QUANTIZED_NUMEL:
            return _int8()
        return Dense(self.dense_dtype(param))

    def block_scaled(self) -> bool:
        """Whether some state may be block-scaled (its scales follow a DTensor's shards:
        ``sharded_scales.check_placements``)."""
        return self.state_dtype == torch.int8

    def loadable(self) -> tuple[StateFormat, ...]:
        """The formats besides dense that a loaded state dict may hold (converted on load)."""
        return (_int8(),)

    @staticmethod
    def specs(fmt, param_shape, keys, matrices: int) -> list:
        """(name, shape, dtype) of every tensor of a parameter's state, in allocation order.
        ``keys``: its algorithm's ``state_shapes`` (``algorithm.StateKey``); ``matrices``
        counts the matrices of a key shaped like the parameter (any other is one run)."""
        out = []
        for key, kind, shape in keys:
            count = matrices if tuple(shape) == tuple(param_shape) else 1
            out.extend(fmt.specs(key, shape, kind, count))
        return out


def _int8() -> Int8:
    from ..kernels import quant_maps  # imported only where 8-bit state is used

    return Int8(quant_maps.QBLOCK)
