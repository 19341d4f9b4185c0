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
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ._launch import TABLES


class GradIndex(NamedTuple):
    """Where a launch reads its gradients' addresses: ``table``, an int64 tensor of addresses
    on the device, and for each gradient of the launch (each segment or matrix, in order) its
    row there. The kernels' pointer tables hold these rows, not the addresses, so a pointer
    table, and a CUDA graph that captured it, stay right for gradients that backward
    allocates afresh each step: the engine rewrites ``table`` every step
    (``engine/grad_table.py``)."""

    table: Tensor
    rows: tuple[int, ...]


def grad_index_for(grads: Sequence[Tensor], index: GradIndex | None) -> GradIndex:
    """``index`` checked against ``grads``, or for a direct call (None) a table of the
    gradients' own addresses (cached by them, as pointer tables are)."""
    device = grads[0].device
    if index is None:
        ptrs = tuple(map(Tensor.data_ptr, grads))
        build = functools.partial(np.array, ptrs, dtype=np.int64)
        table = TABLES.get(("grad_addresses", device.index, ptrs), build, device)
        return GradIndex(table, tuple(range(len(ptrs))))
    table, rows = index
    if (
        len(rows) != len(grads)
        or table.dtype != torch.int64
        or table.device != device
        or not table.is_contiguous()
        or (rows and not 0 <= min(rows) <= max(rows) < table.numel())
    ):
        raise ValueError(
            f"grad_index must give one row of a contiguous int64 table on {device} for each "
            f"of the {len(grads)} gradients"
        )
    return index
