"""A small host -> device copy a step through a ring of pinned buffers.

A non-blocking copy reads its pinned source when the GPU gets to it, so the host may rewrite
that source only once the copy has run. With ``ring`` buffers used in turn, the host waits (on
the event recorded after the copy) only when it is ``ring`` steps ahead of the GPU.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class HostRing:
    """Copies numpy values into a device tensor through ``ring`` pinned host buffers (on a CPU
    device: directly)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, ring: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = dtype
        self.ring = ring
        self._host: list[Tensor] = []
        self._host_np: list[np.ndarray] = []
        self._copied: list[torch.cuda.Event | None] = []
        self._turn = 0

    def copy(self, values: np.ndarray, out: Tensor) -> None:
        """``out[:n] = values`` (n values of ``out``'s dtype), queued on the current stream."""
        n = values.size
        if not self.cuda:
            out[:n].copy_(torch.from_numpy(values))
            return
        if not self._host or self._host[0].numel() < n:
            self._grow(out.numel())
        k = self._turn
        self._turn = (k + 1) % self.ring
        event = self._copied[k]
        if event is not None:
            event.synchronize()  # the copy that last read this host buffer has run
        self._host_np[k][:n] = values
        out[:n].copy_(self._host[k][:n], non_blocking=True)
        if event is None:
            event = self._copied[k] = torch.cuda.Event()
        event.record()

    def _grow(self, size: int) -> None:
        for event in self._copied:  # the old buffers' last copies have run before they go
            if event is not None:
                event.synchronize()
        self._host = [
            torch.zeros(size, dtype=self.dtype, pin_memory=True) for _ in range(self.ring)
        ]
        self._host_np = [h.numpy() for h in self._host]
        self._copied = [None] * self.ring
