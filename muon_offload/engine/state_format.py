"""How one parameter's state is stored: dense (one tensor a key), or 8-bit (codes and one
fp32 scale per block of ``block`` elements, a pair a key).

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


@dataclass(frozen=True)
class Dense:
    dtype: torch.dtype
    quantized = False

    @property
    def align(self) -> int:
        return SEGMENT_ALIGN

    def names(self, key: str) -> tuple[str, ...]:
        return (key,)

    def specs(self, key: str, shape: torch.Size, code_dtype=None, matrices: int = 1):
        return [(key, torch.Size(shape), self.dtype)]

    def nbytes(self, numel: int, nkeys: int) -> int:
        return nkeys * numel * self.dtype.itemsize

    def segment(self, name: str, t: Tensor, span: slice) -> Tensor:
        return t.view(-1)[span]

    def matrices(self, name: str, t: Tensor, piece) -> Tensor:
        """Matrices [start, stop) of a stack's state (``planner.Matrices``)."""
        return t.view(-1, *t.shape[-2:])[piece.start : piece.stop]


@dataclass(frozen=True)
class Int8:
    block: int
    quantized = True

    @property
    def align(self) -> int:
        return math.lcm(SEGMENT_ALIGN, self.block)

    def names(self, key: str) -> tuple[str, ...]:
        return (f"{key}_codes", f"{key}_scales")

    def scales_shape(self, shape: torch.Size, matrices: int) -> torch.Size:
        numel = math.prod(shape)
        if matrices > 1:
            return torch.Size((matrices, -(-(numel // matrices) // self.block)))
        return torch.Size((-(-numel // self.block),))

    def specs(self, key: str, shape: torch.Size, code_dtype=torch.int8, matrices: int = 1):
        codes, scales = self.names(key)
        return [
            (codes, torch.Size(shape), code_dtype),
            (scales, self.scales_shape(shape, matrices), torch.float32),
        ]

    def nbytes(self, numel: int, nkeys: int) -> int:
        return nkeys * (numel + 4 * -(-numel // self.block))

    def encode(self, x: Tensor, kind: str, scales_shape: torch.Size) -> tuple[Tensor, Tensor]:
        """Dense state -> (codes, scales), block by block of each matrix (one row of
        ``scales_shape`` a matrix), at the checkpoint boundary."""
        from ..kernels import quant_maps

        rows = scales_shape[0] if len(scales_shape) == 2 else 1
        pieces = [quant_maps.quantize(m, kind) for m in x.reshape(rows, -1).float().unbind(0)]
        codes = torch.cat([c.reshape(-1) for c, _ in pieces]).reshape(x.shape)
        return codes, torch.stack([s.reshape(-1) for _, s in pieces]).reshape(scales_shape)

    def decode(self, codes: Tensor, scales: Tensor, kind: str) -> Tensor:
        """(codes, scales) -> float32 state, the inverse of ``encode``."""
        from ..kernels import quant_maps

        rows = scales.shape[0] if scales.ndim == 2 else 1
        flat_scales = scales.reshape(rows, -1)
        out = [
            quant_maps.dequantize(c, s, kind).reshape(-1)
            for c, s in zip(codes.reshape(rows, -1).unbind(0), flat_scales.unbind(0), strict=True)
        ]
        return torch.cat(out).reshape(codes.shape)

    def segment(self, name: str, t: Tensor, span: slice) -> Tensor:
        if name.endswith("_scales"):
            # Segments start on block boundaries (align); the last may end mid-block.
            return t.view(-1)[span.start // self.block : -(-span.stop // self.block)]
        return t.view(-1)[span]

    def matrices(self, name: str, t: Tensor, piece) -> Tensor:
        """Matrices [start, stop) of a stack's state (``planner.Matrices``): their codes, and
        their rows of scales (one a matrix: a block never spans two matrices)."""
        if name.endswith("_scales"):
            return t[piece.start : piece.stop]
        return t.view(-1, *t.shape[-2:])[piece.start : piece.stop]


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

    def format_for(self, param: Tensor) -> Dense | Int8:
        if self.state_dtype == torch.int8 and param.numel() >= MIN_QUANTIZED_NUMEL:
            from ..kernels import quant_maps  # imported only where 8-bit state is used

            return Int8(quant_maps.QBLOCK)
        return Dense(self.dense_dtype(param))

    @staticmethod
    def specs(fmt, param_shape, keys, kinds, matrices: int) -> list:
        """(name, shape, dtype) of every tensor of a parameter's state, in allocation order."""
        out = []
        for key, kind in zip(keys, kinds, strict=True):
            code_dtype = None
            if fmt.quantized:
                from ..kernels import quant_maps

                code_dtype = quant_maps.CODE_DTYPES[kind]
            out.extend(fmt.specs(key, param_shape, code_dtype, matrices))
        return out
