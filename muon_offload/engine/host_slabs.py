"""Optimizer state in host memory: a few large slabs, allocated (and pinned) once, with
every state tensor living inside them.

Each state tensor sits on a storage of its own that covers exactly its bytes of a slab (a
sliced ``UntypedStorage``, which keeps the slab alive): ``torch.save`` then writes a tensor's
own bytes, never the whole slab, and tensors of different dtypes side by side in one slab
save together (torch refuses two dtypes viewing one storage). The scheduler copies whole
runs of the slabs (``slab_of``), so neighbours still move as one copy.

Pinning is slow (about 2 GB/s on the H200 host, docs/benchmarks.md) and must never happen on the
hot path, so slabs are allocated when state is first created and reused forever after;
``load_state_dict`` writes into them. Tensors are placed in the order they are asked for,
which is the planner's order, so the state of one chunk is mostly one contiguous range and
loads as one copy.
"""

from __future__ import annotations

import bisect
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
        self._starts: list[tuple[int, int]] = []  # (address, index into slabs), sorted

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
        for slab in new:
            bisect.insort(self._starts, (slab.data_ptr(), len(self.slabs)))
            self.slabs.append(slab)
        return [
            _own_storage(new[slab], offset, shape, dtype)
            for (slab, offset), (shape, dtype) in zip(layout, specs, strict=True)
        ]

    def slab_of(self, t: Tensor) -> Tensor:
        """The slab (uint8) holding ``t``."""
        addr = t.data_ptr()
        i = bisect.bisect_right(self._starts, (addr, len(self.slabs))) - 1
        if i >= 0:
            slab = self.slabs[self._starts[i][1]]
            if addr + t.numel() * t.element_size() <= slab.data_ptr() + slab.numel():
                return slab
        raise ValueError("tensor is not inside the host slabs")

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


def _own_storage(slab: Tensor, offset: int, shape, dtype: torch.dtype) -> Tensor:
    """A tensor on a storage of exactly its own bytes of ``slab``, starting at ``offset``."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    storage = slab.untyped_storage()[offset : offset + nbytes]
    return torch.empty(0, dtype=dtype).set_(storage, 0, torch.Size(shape))
