"""The step's gradient table: the address of every gradient piece the step's kernels read, in
one int64 buffer on the device, rewritten every step.

torch's default ``zero_grad()`` sets gradients to None, so backward allocates them afresh each
step, at new addresses. The kernels read a gradient's address from this table (their pointer
tables hold its row: ``kernels/_launch.GradIndex``), so pointer tables built once and a CUDA
graph captured once (``graphs.py``) serve every step: the host writes this step's addresses
(one vectorized pass over the data pointers the step's checks read) and copies them to the
device before the step's launches, once a step, as the scalar table (``scalars.py``) does. A
graph's key then holds what the graph bakes of the gradients (their dtypes and 16-byte
alignment, which parameters have one), not their addresses.

Rows, per plan: for each unit in plan order, for each of its items (parameter, element-wise
segment, or some matrices of a stack), each piece that a kernel reads
(``Algorithm.grad_pieces``: a Muon stack's matrices) at its parameter's gradient's data pointer
plus the piece's byte offset.

A DTensor's rows are its local shard's (the address, shape and heads this rank reads). A step
whose gradients are not all contiguous (a transposed gradient that the step copies afresh) gets
no table: the launchers read those gradients' own addresses (and such a step is never
captured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from ..distributed import DTensor, local
from ..kernels._grad_index import GradIndex
from ..kernels._launch import ALIGN_BYTES
from .algorithm import reads_tables
from .chunks import ChunkLayout
from .host_ring import HostRing
from .planner import Matrices, unit_params
from .step_work import StepWork


def grad_table(table: GradTable | None, algorithms: dict, backend: str, device) -> GradTable | None:
    """The table a step on ``device`` uses (``table`` when it fits): None where none of
    ``algorithms`` (by name) reads it there (``Algorithm.reads_tables``: the torch path,
    whose references take the gradients as tensors)."""
    if not reads_tables(algorithms.values(), backend, device):
        return None
    return table if table is not None and table.device == device else GradTable(device)


class GradTable:
    """Owns the device buffer of the step's gradient addresses and the rows each unit reads."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._ring = HostRing(self.device, torch.int64)
        self._buf: Tensor | None = None
        # What the rows were laid out for: the plan's layouts, the gradients' dtypes.
        self._layouts: Sequence[ChunkLayout] | None = None
        self._grad_dtypes: tuple | None = None
        self._param = np.zeros(0, dtype=np.int64)  # each row's parameter (work position)
        self._offset = np.zeros(0, dtype=np.int64)  # each row's byte offset in its gradient
        self._index: list[list[GradIndex]] = []
        # This step's rows whose address is not 16-byte aligned (the kernels are compiled for
        # an alignment: a graph's key), as bytes; None when the step got no table.
        self.misaligned: bytes | None = None

    def key(self) -> tuple | None:
        """What a graph captured of this step's gradients bakes (``graphs.step_key``): the
        buffer's address and size, the rows not 16-byte aligned; None when the step got no
        table (the launchers read the gradients' own addresses)."""
        if self.misaligned is None:
            return None
        return self._buf.data_ptr(), self._buf.numel(), self.misaligned

    def write(self, layouts: Sequence[ChunkLayout], hypers, work: StepWork):
        """Write this step's gradient addresses to the device; return, for each chunk, each
        unit's ``GradIndex`` (the same objects while the plan and the gradients' dtypes hold),
        or None where the gradients cannot be read through the table."""
        self.misaligned = None
        if work.pointers is not None:  # read with the step's checks
            _, grad_ptrs, contiguous = work.pointers
        else:  # a DTensor's: its shard's (the DTensor's own data_ptr() is 0)
            grads = work.grads if work.plain else tuple(map(local, work.grads))
            grad_ptrs = tuple(map(Tensor.data_ptr, grads))
            contiguous = all(map(Tensor.is_contiguous, grads))
        if not contiguous:
            return None
        if layouts is not self._layouts or work.grad_dtypes != self._grad_dtypes:
            self._lay_out(layouts, hypers, work)
        addresses = np.fromiter(grad_ptrs, dtype=np.int64, count=len(grad_ptrs))[self._param]
        addresses += self._offset
        self.misaligned = np.flatnonzero(addresses % ALIGN_BYTES).tobytes()
        self._ring.copy(addresses, self._buf)
        return self._index

    def _lay_out(self, layouts, hypers, work: StepWork) -> None:
        params, offsets, spans = [], [], []
        for layout in layouts:
            for u in layout.units:
                start = len(params)
                hyper = hypers[u.unit.group]
                for pos, p, span in zip(unit_params(u.unit), u.params, u.spans, strict=True):
                    size = work.grad_dtypes[pos].itemsize
                    first, shape = _item(span, tuple(local(p).shape))
                    for piece in u.algorithm.grad_pieces(_shard_hyper(hyper, p), shape):
                        params.append(pos)
                        offsets.append((first + piece) * size)
                spans.append((start, len(params)))
        size = max(len(params), 1)
        if self._buf is None or self._buf.numel() < size:
            # Grown, never shrunk. The old buffer's last readers ran on this stream (or were
            # joined back into it), so the allocator may hand it out again safely.
            capacity = max(64, 1 << (size - 1).bit_length())
            self._buf = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        rows = iter(spans)
        self._index = [
            [GradIndex(self._buf, tuple(range(*next(rows)))) for _ in layout.units]
            for layout in layouts
        ]
        self._param = np.array(params, dtype=np.int64)
        self._offset = np.array(offsets, dtype=np.int64)
        self._layouts, self._grad_dtypes = layouts, work.grad_dtypes


def _shard_hyper(hyper, p: Tensor):
    """The hyper-parameters a shard is cut by: a DTensor sharded on its heads (``num_heads``,
    dim 0) holds whole heads, its share of them (none: an empty shard, no pieces)."""
    if not hyper.num_heads or not isinstance(p, DTensor) or local(p).shape[0] == p.shape[0]:
        return hyper
    return replace(hyper, num_heads=hyper.num_heads * local(p).shape[0] // p.shape[0] or None)


def _item(span, shape: tuple) -> tuple[int, tuple]:
    """An item's first element in its parameter's gradient, and the shape its pieces are cut
    from: the parameter's, or a stack piece's ``(matrices, rows, cols)``."""
    if isinstance(span, Matrices):
        rows, cols = shape[-2:]
        return span.start * rows * cols, (span.stop - span.start, rows, cols)
    return (0 if span is None else span.start), shape
