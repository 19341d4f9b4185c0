"""The step's scalar table: every launch's runtime scalars for one step, in one fp32 buffer on
the device.

The kernels read their learning rates, decays, bias corrections and momentum from memory,
not from launch arguments, so that a captured CUDA graph (``graphs.py``) replays each step
with that step's values. Eager steps take the same path (one small copy a step), so a replay
equals the eager step by construction.

Each row holds one algorithm's scalars for one group (and, for Muon, one matrix shape: its
adjusted learning rate; for AdamW, one step count, each parameter's own: ``step_counts.py``),
as ``Algorithm.scalars`` computes them in Python floats; they are
rounded to fp32 on the host (to nearest, as Triton rounds a Python float argument) and copied
host -> device once a step on the current stream, before any launch that reads them. Rows
start 16 bytes apart, so every row pointer is as aligned as a fresh tensor (Triton
specializes pointer arguments on 16-byte alignment: one compiled variant for all).

The host side is a ring of pinned buffers: a buffer is rewritten only after the copy that
read it (``ring`` steps earlier) has run, which its event tells without stalling the host
while the GPU is less than ``ring`` steps behind.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .algorithm import reads_tables
from .chunks import ChunkLayout
from .host_ring import HostRing

ROW_ALIGN = 4  # fp32 values: 16 bytes


def _rows(layouts: Sequence[ChunkLayout]):
    """The distinct rows of a plan, (group, algorithm, matrix shape or None, the work item
    whose step count the row reads or None for the group's), and for each chunk each unit's
    row index."""
    index: dict[tuple, int] = {}
    rows, unit_rows = [], []
    for layout in layouts:
        mine = []
        for u in layout.units:
            shape = None if u.algorithm.elementwise else tuple(u.params[0].shape)
            key = (u.unit.group, u.algorithm.name, shape, u.step_class)
            if key not in index:
                index[key] = len(rows)
                rows.append((u.unit.group, u.algorithm, shape, u.step_item))
            mine.append(index[key])
        unit_rows.append(mine)
    return rows, unit_rows


def scalar_table(
    table: ScalarTable | None, algorithms: dict, backend: str, device
) -> ScalarTable | None:
    """The table a step on ``device`` uses (``table`` when it fits): None where none of
    ``algorithms`` (by name) reads it there (``Algorithm.reads_tables``: the torch path,
    whose references take Python numbers)."""
    if not reads_tables(algorithms.values(), backend, device):
        return None
    return table if table is not None and table.device == device else ScalarTable(device)


class ScalarTable:
    """Owns the device buffer of the step's scalars and the pinned host ring that feeds it."""

    def __init__(self, device: torch.device, ring: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._device_buf: Tensor | None = None
        self._ring = HostRing(self.device, torch.float32, ring)
        # The last plan's layout: its rows, offsets, and each unit's view of its row.
        self._layouts: Sequence[ChunkLayout] | None = None
        self._rows: list[tuple] = []
        self._offsets: list[int] = []
        self._views: list[list[Tensor]] = []
        self._values = np.zeros(0, dtype=np.float32)

    @property
    def buffer(self) -> Tensor | None:
        """The device buffer the kernels read (a captured graph reads it by address)."""
        return self._device_buf

    def write(self, layouts: Sequence[ChunkLayout], hypers, steps, counts=()) -> list[list[Tensor]]:
        """Compute this step's rows, copy them to the device; return, for each chunk, each
        unit's row (a view of the device buffer, the same tensors while the plan holds).
        ``steps``: each group's step count; ``counts``: each work item's own (this step
        included, both)."""
        if layouts is not self._layouts:
            self._lay_out(layouts, hypers, steps)
        values = self._values  # padding stays zero; every row is rewritten
        for (group, algorithm, shape, item), at in zip(self._rows, self._offsets, strict=True):
            step = steps[group] if item is None else int(counts[item])
            row = algorithm.scalars(hypers[group], step, shape)
            values[at : at + len(row)] = row  # fp64 -> fp32, to nearest
        self._ring.copy(values, self._device_buf)
        return self._views

    def _lay_out(self, layouts, hypers, steps) -> None:
        rows, unit_rows = _rows(layouts)
        offsets, lengths, size = [], [], 0
        for group, algorithm, shape, _ in rows:
            offsets.append(size)
            lengths.append(len(algorithm.scalars(hypers[group], steps[group], shape)))
            size += -(-lengths[-1] // ROW_ALIGN) * ROW_ALIGN
        size = max(size, ROW_ALIGN)
        if self._device_buf is None or self._device_buf.numel() < size:
            # Grown, never shrunk. The old buffer's last readers ran on this stream (or were
            # joined back into it), so the allocator may hand it out again safely.
            capacity = max(64, 1 << (size - 1).bit_length())
            self._device_buf = torch.zeros(capacity, dtype=torch.float32, device=self.device)
        buf = self._device_buf
        self._views = [
            [buf[offsets[r] : offsets[r] + lengths[r]] for r in mine] for mine in unit_rows
        ]
        self._rows, self._offsets = rows, offsets
        self._values = np.zeros(size, dtype=np.float32)  # this plan's rows, filled each step
        self._layouts = layouts
