"""Gradients read through a table of their addresses (``GradIndex``).

A launcher's pointer table holds, for each gradient, a row of an int64 table of addresses
instead of the address itself. The engine fills that table every step with the step's
gradients (``engine/grad_table.py``): torch's default ``zero_grad()`` has backward allocate
them afresh each step, and a pointer table cached by its contents, or captured into a CUDA
graph, must not name last step's gradient. A direct launcher call gets a table of its
gradients' own addresses (``grad_index_for``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ._launch import TABLES, scratch_like
from ._tables import aligned_addresses


class GradIndex(NamedTuple):
    """Where a launch reads its gradients' addresses: ``table``, an int64 tensor of addresses
    on the device, and for each gradient of the launch (each segment or matrix, in order) its
    row there. The kernels' pointer tables hold these rows, not the addresses, so a pointer
    table, and a CUDA graph that captured it, stay right for gradients that backward
    allocates afresh each step: the engine rewrites ``table`` every step
    (``engine/grad_table.py``)."""

    table: Tensor
    rows: tuple[int, ...]


@dataclass(frozen=True)
class TabledGrads:
    """Gradient matrices that a launch reads only through its ``GradIndex``, described
    instead of listed: their count, the matrix shape, dtype and device, and whether every
    address is a multiple of ``ALIGN_BYTES``. The prep launchers take it for ``grads`` where
    the engine's gradient table serves them: backward allocates the gradients afresh each step,
    so a view a matrix (a 3-D expert stack's 48) would be made, checked and dropped every step
    only to be read for these few facts, which the engine has already checked (each gradient
    has its parameter's shape and dtype, contiguous: ``engine/grad_table.py``)."""

    count: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    aligned: bool

    def check(self, count: int, shape, device, index: GradIndex | None) -> None:
        """Refuse a description that does not match the launch's momentum matrices, or
        comes without the table it reads through."""
        if index is None:
            raise ValueError("TabledGrads needs a grad_index: the table the kernels read")
        if (self.count, tuple(self.shape), self.device) != (count, tuple(shape), device):
            raise ValueError(
                f"grads: {self.count} matrices of shape {tuple(self.shape)} on {self.device}, "
                f"expected {count} of {tuple(shape)} on {device}"
            )


def grads_dtype(grads: Sequence[Tensor] | TabledGrads) -> torch.dtype:
    return grads.dtype if isinstance(grads, TabledGrads) else grads[0].dtype


def grads_aligned(grads: Sequence[Tensor] | TabledGrads) -> bool:
    """Whether every gradient's address is a multiple of ``ALIGN_BYTES``."""
    if isinstance(grads, TabledGrads):
        return grads.aligned
    return aligned_addresses(map(Tensor.data_ptr, grads))


def scratch_grads(grads: Sequence[Tensor] | TabledGrads) -> list[Tensor]:
    """Fresh random gradients like ``grads`` (a tuning run's scratch inputs)."""
    if isinstance(grads, TabledGrads):
        like = torch.empty(grads.shape, dtype=grads.dtype, device=grads.device)
        return scratch_like([like] * grads.count)
    return scratch_like(grads)


def grad_index_for(grads: Sequence[Tensor] | TabledGrads, index: GradIndex | None) -> GradIndex:
    """``index`` checked against ``grads``, or for a direct call (None) a table of the
    gradients' own addresses (cached by them, as pointer tables are)."""
    if isinstance(grads, TabledGrads):
        device, count = grads.device, grads.count
    else:
        device, count = grads[0].device, len(grads)
    if index is None:
        if isinstance(grads, TabledGrads):
            raise ValueError("TabledGrads needs a grad_index: the table the kernels read")
        ptrs = tuple(map(Tensor.data_ptr, grads))
        build = functools.partial(np.array, ptrs, dtype=np.int64)
        table = TABLES.get(("grad_addresses", device.index, ptrs), build, device)
        return GradIndex(table, tuple(range(len(ptrs))))
    table, rows = index
    if (
        len(rows) != count
        or table.dtype != torch.int64
        or table.device != device
        or not table.is_contiguous()
        or (rows and not 0 <= min(rows) <= max(rows) < table.numel())
    ):
        raise ValueError(
            f"grad_index must give one row of a contiguous int64 table on {device} for each "
            f"of the {count} gradients"
        )
    return index
