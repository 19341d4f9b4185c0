"""Optimizer state in host memory: a few large slabs, allocated (and pinned) once, with
every state tensor living inside them.

Each state tensor sits on a storage of its own that covers exactly its bytes of a slab (a
sliced ``UntypedStorage``, which keeps the slab alive): ``torch.save`` then writes a tensor's
own bytes, never the whole slab, and tensors of different dtypes side by side in one slab
save together (torch refuses two dtypes viewing one storage). The scheduler copies whole
runs of the slabs (``slab_of``), so neighbours still move as one copy.

Pinning is slow (about 2 GB/s on the H200 host, docs/benchmarks.md) and must never happen on the
hot path, so slabs are allocated when state is first created and reused after;
``load_state_dict`` writes into them. Tensors are placed in the order they are asked for,
which is the planner's order, so the state of one chunk is mostly one contiguous range and
loads as one copy.

State that is dropped (``del opt.state[p]``, a new ``opt.state``) leaves its bytes behind: once
nothing holds a tensor's storage any more (a weak reference to it has expired), the next
``allocate`` reuses its range, and gives back a slab that then holds nothing. Bytes still held
elsewhere (a state dict kept by the caller) are never reused. An owner's tensors (a parameter's
state) made afresh go back into the bytes it left first: state dropped for some parameters is
made in the order of a plan of those alone, and placed first-fit, a small tensor took the bytes
a large one had left between chunks of the full plan, which then went to a new slab.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Sequence
from operator import itemgetter

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

log = logging.getLogger(__name__)

ALIGN_BYTES = 256  # every tensor starts on a 256-byte boundary: 16-byte vector loads and
# cudaMemcpy's fast path both want it, and the scheduler keeps the same alignment on device
DEFAULT_SLAB_BYTES = 1 << 30


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return -(-n // align) * align


class HostSlabs:
    """Host memory for streamed state: ``allocate`` returns zeroed views into large slabs,
    into the ranges of tensors that are gone first."""

    def __init__(self, pin: bool, slab_bytes: int = DEFAULT_SLAB_BYTES):
        self.pin = pin
        self.slab_bytes = slab_bytes
        self.slabs: list[Tensor] = []  # uint8 buffers
        self._starts: list[tuple[int, int]] = []  # (address, index into slabs), sorted
        # For each slab, the tensors placed in it: (byte offset, bytes, their storage, weakly).
        self._placed: list[list[tuple[int, int, StorageWeakRef]]] = []
        # Owner -> for each of its tensors, the addresses it has had, the earliest first.
        self._homes: dict[object, list[list[int]]] = {}

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.slabs)

    def allocate(
        self, specs: list[tuple[torch.Size, torch.dtype]], owners: Sequence | None = None
    ) -> list[Tensor]:
        """Zeroed tensors of the given shapes and dtypes, as views into the slabs. ``owners``:
        each one's owner (hashable); an owner's k-th tensor goes back to the earliest place
        its k-th tensor has had whose bytes are free. The others go each into the free range
        the one before it went to while it fits there, else into the first free range it fits
        in, else into new slabs."""
        sizes = [align_up(torch.Size(shape).numel() * dtype.itemsize) for shape, dtype in specs]
        free = self._free_ranges()
        # (slab index, byte offset); None: not placed yet, then a new slab.
        places: list[tuple[int, int] | None] = [None] * len(sizes)
        homes = self._home_addresses(owners, len(sizes))
        for i, addresses in enumerate(homes):
            for addr in addresses if sizes[i] else ():
                places[i] = self._claim(free, addr, sizes[i])
                if places[i] is not None:
                    break
        at = None  # the free range being filled
        for i, size in enumerate(sizes):
            if places[i] is not None:
                continue
            if at is None or free[at][2] - free[at][1] < size:
                at = next((j for j, (_, lo, hi) in enumerate(free) if hi - lo >= size), None)
            if at is None:
                continue
            slab, lo, hi = free[at]
            places[i] = (slab, lo)
            free[at] = (slab, lo + size, hi)
        # Lay the rest out in order, opening a new slab when the next one does not fit.
        slab_sizes: list[int] = []
        for i, size in enumerate(sizes):
            if places[i] is not None:
                continue
            if not slab_sizes or slab_sizes[-1] + size > self.slab_bytes:
                slab_sizes.append(0)
            places[i] = (len(self.slabs) + len(slab_sizes) - 1, slab_sizes[-1])
            slab_sizes[-1] += size
        reused = len(self.slabs)
        for slab in [self._new_slab(n) for n in slab_sizes]:
            self.slabs.append(slab)
            self._placed.append([])
        tensors = []
        for (slab, offset), size, (shape, dtype) in zip(places, sizes, specs, strict=True):
            t = _own_storage(self.slabs[slab], offset, shape, dtype)
            if size:
                if slab < reused:  # new slabs come zeroed
                    self.slabs[slab][offset : offset + size].zero_()
                self._placed[slab].append((offset, size, StorageWeakRef(t.untyped_storage())))
            tensors.append(t)
        self._give_back_empty()
        self._starts = sorted((slab.data_ptr(), i) for i, slab in enumerate(self.slabs))
        if owners is not None:
            self._keep_homes(owners, homes, tensors)
        return tensors

    def _keep_homes(self, owners: Sequence, homes: list, tensors: list[Tensor]) -> None:
        """Each owner's places: those it had that still lie in a slab, and the new ones."""
        kept: dict[object, list[list[int]]] = {}
        for owner, had, t in zip(owners, homes, tensors, strict=True):
            places = [a for a in had if self._inside(a)]
            if t.data_ptr() not in places:
                places.append(t.data_ptr())
            kept.setdefault(owner, []).append(places)
        self._homes.update(kept)

    def _inside(self, addr: int) -> bool:
        k = bisect.bisect_right(self._starts, (addr, len(self.slabs))) - 1
        return k >= 0 and addr < self._starts[k][0] + self.slabs[self._starts[k][1]].numel()

    def _home_addresses(self, owners: Sequence | None, count: int) -> list[list[int]]:
        """For each tensor asked for, the places its owner's tensor of the same rank has had,
        the earliest first (none without an owner)."""
        if owners is None:
            return [[] for _ in range(count)]
        seen: dict[object, int] = {}
        addresses = []
        for owner in owners:
            k = seen[owner] = seen.get(owner, -1) + 1
            home = self._homes.get(owner, ())
            addresses.append(home[k] if k < len(home) else [])
        return addresses

    def _claim(self, free: list, addr: int, size: int) -> tuple[int, int] | None:
        """Take ``size`` bytes at ``addr`` out of ``free`` (sorted (slab index, first byte,
        end) ranges) if they lie in one: (slab index, byte offset); else None."""
        k = bisect.bisect_right(self._starts, (addr, len(self.slabs))) - 1
        if k < 0:
            return None
        slab = self._starts[k][1]
        offset = addr - self._starts[k][0]
        j = bisect.bisect_right(free, (slab, offset, math.inf)) - 1
        if j < 0 or free[j][0] != slab or offset + size > free[j][2]:
            return None
        _, lo, hi = free[j]
        free[j : j + 1] = [
            r for r in ((slab, lo, offset), (slab, offset + size, hi)) if r[1] < r[2]
        ]
        return slab, offset

    def _free_ranges(self) -> list[tuple[int, int, int]]:
        """(slab index, first byte, end) of every range no live tensor holds, in address order
        within each slab; forgets the tensors that are gone."""
        free = []
        for i, (slab, placed) in enumerate(zip(self.slabs, self._placed, strict=True)):
            placed[:] = sorted((e for e in placed if not e[2].expired()), key=itemgetter(0))
            cursor = 0
            for offset, size, _ in placed:
                if offset > cursor:
                    free.append((i, cursor, offset))
                cursor = max(cursor, offset + size)
            if cursor < slab.numel():
                free.append((i, cursor, slab.numel()))
        return free

    def _give_back_empty(self) -> None:
        """Drop the slabs that hold no live tensor (their memory is freed once nothing else,
        such as an old plan's copies, holds it)."""
        keep = [i for i, placed in enumerate(self._placed) if placed]
        self.slabs = [self.slabs[i] for i in keep]
        self._placed = [self._placed[i] for i in keep]

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
