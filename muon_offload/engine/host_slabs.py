"""Optimizer state in host memory: a few large slabs, allocated (and pinned) once, with
every state tensor a view into them.

Pinning is slow (about 2 GB/s on the H200 host, ANCHORS.md) and must never happen on the
hot path, so slabs are allocated when state is first created and reused forever after;
``load_state_dict`` writes into them. Tensors are placed in the order they are asked for,
which is the planner's order, so the state of one chunk is mostly one contiguous range and
loads as one copy.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

ALIGN_BYTES = 256  # every tensor starts on a 256-byte boundary: 16-byte vector loads and
# cudaMemcpy's fast path both want it, and the scheduler keeps the same alignment on device
DEFAULT_SLAB_BYTES = 1 << 30


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return -(-n // align) * align


class HostSlabs:
    """Append-only host memory: ``allocate`` returns zeroed views into large slabs."""

    def __init__(self, pin: bool, slab_bytes: int = DEFAULT_SLAB_BYTES):
        self.pin = pin
        self.slab_bytes = slab_bytes
        self.slabs: list[Tensor] = []  # uint8 buffers

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.slabs)

    def allocate(self, specs: list[tuple[torch.Size, torch.dtype]]) -> list[Tensor]:
        """Zeroed tensors of the given shapes and dtypes, as views into new slabs."""
        sizes = [align_up(torch.Size(shape).numel() * dtype.itemsize) for shape, dtype in specs]
        # Lay the tensors out in order, opening a new slab when the next one does not fit.
        layout: list[tuple[int, int]] = []  # (slab number among the new ones, byte offset)
        slab_sizes: list[int] = []
        for size in sizes:
            if not slab_sizes or slab_sizes[-1] + size > self.slab_bytes:
                slab_sizes.append(0)
            layout.append((len(slab_sizes) - 1, slab_sizes[-1]))
            slab_sizes[-1] += size
        new = [self._new_slab(n) for n in slab_sizes]
        self.slabs.extend(new)
        return [
            new[slab][offset : offset + torch.Size(shape).numel() * dtype.itemsize]
            .view(dtype)
            .view(shape)
            for (slab, offset), (shape, dtype) in zip(layout, specs, strict=True)
        ]

    def _new_slab(self, nbytes: int) -> Tensor:
        try:
            slab = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as err:
            kind = "pinned host" if self.pin else "host"
            raise MemoryError(
                f"could not allocate {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of {kind} memory "
                f"for optimizer state ({self.nbytes / 2**30:.2f} GiB already held): {err}"
            ) from err
        slab.zero_()
        if self.pin:
            log.info("pinned %.2f GiB of host memory for optimizer state", nbytes / 2**30)
        return slab
