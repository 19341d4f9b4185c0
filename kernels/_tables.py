"""Pointer tables: how multi-tensor kernels reach their segments.

A table is an int64 tensor on the device whose rows hold the segments' addresses (the kernel
casts them to typed pointers). Tables are built on the host with numpy and cached by the
addresses and sizes they describe, so a step that reuses its staging buffers and parameters
re-sends nothing; under a CUDA graph capture a table missing from the cache raises
``CaptureMiss``, and the tables a capture reads are held for the graph's life
(``TableCache.holding``). Also here: the checks of a launch's parallel segment lists, their
grouping by dtype, and the alignment a launch may promise the compiler."""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from functools import reduce

import numpy as np
import torch
from torch import Tensor

from ._capture import CaptureMiss, capturing

SHAPE, DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")  # for ``map``

# Address alignment (bytes) that the kernels may promise the compiler for 16-byte accesses.
ALIGN_BYTES = 16


def check_lists(names: Sequence[str], lists: Sequence[Sequence[Tensor]]) -> list[int]:
    """Validate parallel segment lists (same lengths and element counts, contiguous, one
    device); return the segments' element counts. This runs on every step, for every chunk,
    over hundreds of matrices: the attribute reads go through ``map`` (a loop in C), not a
    Python loop a tensor."""
    count = len(lists[0])
    numels = list(map(Tensor.numel, lists[0]))
    devices = set()
    for name, tensors in zip(names, lists, strict=True):
        if len(tensors) != count:
            raise ValueError(f"{name}: {len(tensors)} tensors, expected {count}")
        if tensors is not lists[0] and list(map(Tensor.numel, tensors)) != numels:
            raise ValueError(f"{name}: element counts differ from {names[0]}'s")
        if not all(map(Tensor.is_contiguous, tensors)):
            raise ValueError(f"{name}: every tensor must be contiguous")
        devices.update(map(Tensor.get_device, tensors))
    if len(devices) > 1:
        raise ValueError(f"tensors on several devices: {sorted(devices)}")
    return numels


def group_by_dtype(lists: Sequence[Sequence[Tensor]]) -> dict[tuple, list[int]]:
    """Segment indices grouped by the tuple of their dtypes (one launch per group)."""
    dtypes = [[t.dtype for t in tensors] for tensors in lists]
    if all(d.count(d[0]) == len(d) for d in dtypes if d):  # the usual case: one group
        return {tuple(d[0] for d in dtypes): list(range(len(dtypes[0])))} if dtypes[0] else {}
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(*dtypes, strict=True)):
        groups.setdefault(key, []).append(i)
    return groups


def chunk_rows(ptrs: np.ndarray, numels: np.ndarray, chunk: int) -> np.ndarray:
    """Rows ``[ptr_0 .. ptr_{k-1}, start, count]``: one per chunk of ``chunk`` elements of each
    segment. ``ptrs`` is [S, k] int64 (base addresses), ``numels`` is [S]."""
    per_seg = np.maximum((numels + chunk - 1) // chunk, 0)
    seg = np.repeat(np.arange(len(numels)), per_seg)
    first = np.cumsum(per_seg) - per_seg
    start = (np.arange(len(seg)) - np.repeat(first, per_seg)) * chunk
    count = np.minimum(numels[seg] - start, chunk)
    return np.concatenate([ptrs[seg], start[:, None], count[:, None]], axis=1).astype(np.int64)


class TableCache:
    """Device copies of pointer tables, keyed by everything their contents depend on.

    A key names the addresses and sizes, so an entry stays correct even when the memory it
    points to is freed and reused: the same key always describes the same table."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self._held: list[Tensor] | None = None  # tables read by the graph being captured

    @contextlib.contextmanager
    def holding(self):
        """Collect every table handed out meanwhile (a capture's): a graph reads them by
        address, so its owner keeps them alive after the cache has let them go."""
        held: list[Tensor] = []
        self._held = held
        try:
            yield held
        finally:
            self._held = None

    def get(self, key: tuple, build: Callable[[], np.ndarray], device: torch.device) -> Tensor:
        with self._lock:
            table = self._entries.get(key)
            if table is not None:
                self._entries.move_to_end(key)
                if self._held is not None:
                    self._held.append(table)
                return table
        if capturing(device):
            raise CaptureMiss(f"pointer table {key[0]!r} was not built before the capture")
        host = torch.from_numpy(np.ascontiguousarray(build()))
        if device.type == "cuda":
            # Pinned + non_blocking: no stream sync; the host allocator keeps the pinned block
            # alive until the copy has run.
            table = host.pin_memory().to(device, non_blocking=True)
        else:
            table = host.to(device)
        with self._lock:
            self._entries[key] = table
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return table

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


TABLES = TableCache()


class Memo(dict):
    """What launches decide from their arguments' metadata (a plan, a descriptor's fields),
    keyed by all it depends on; emptied when it holds ``capacity`` keys (a step's keys come
    back at once after that)."""

    def __init__(self, capacity: int = 4096):
        super().__init__()
        self.capacity = capacity

    def put(self, key, value):
        if len(self) >= self.capacity:
            self.clear()
        self[key] = value
        return value


def all_aligned(lists: Sequence[Sequence[Tensor]]) -> bool:
    return aligned_addresses(*(map(Tensor.data_ptr, tensors) for tensors in lists))


def aligned_addresses(*addresses: Iterable[int]) -> bool:
    """Whether every address is a multiple of ``ALIGN_BYTES`` (a power of two): their OR, a
    loop in C, has none of its low bits set."""
    return not reduce(operator.or_, itertools.chain(*addresses), 0) & (ALIGN_BYTES - 1)
