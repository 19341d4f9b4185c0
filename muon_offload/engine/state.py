"""Creating optimizer state: where each parameter's state lives and the tensors that hold it.

State is created once per parameter, in the planner's order, so that the state of one chunk
is mostly one contiguous range of the host slabs and loads as one copy. Resident state sits
beside the parameter; streamed state is a view into pinned host slabs (``host_slabs.py``).
A DTensor parameter's state is a DTensor of the same layout around the local tensor, so
``state_dict()`` and distributed checkpointing see it sharded like the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..distributed import DTensor, dtensor_around, local
from .host_slabs import HostSlabs


@dataclass(frozen=True)
class NewState:
    """One parameter whose state is to be created."""

    param: Tensor
    keys: tuple[str, ...]
    dtype: torch.dtype
    streamed: bool


class StateStore:
    """Holds the host slabs and knows which parameters' state is streamed."""

    def __init__(self) -> None:
        self.host: HostSlabs | None = None
        self.streamed: set[Tensor] = set()  # parameters whose state lives in host memory
        self.resident_used = 0  # bytes of offload-mode state kept resident (resident_bytes)

    def create(self, state: dict, new: list[NewState]) -> None:
        """Fill ``state[p]`` for each entry, in the given order."""
        streamed = []
        for entry in new:
            p = entry.param
            if entry.streamed:
                streamed.append(entry)
                self.streamed.add(p)
                continue
            state[p].update(
                {
                    k: like_param(torch.zeros_like(local(p), dtype=entry.dtype), p)
                    for k in entry.keys
                }
            )
        if not streamed:
            return
        if self.host is None:
            self.host = HostSlabs(pin=local(streamed[0].param).is_cuda)
        specs = [(local(e.param).shape, e.dtype) for e in streamed for _ in e.keys]
        tensors = iter(self.host.allocate(specs))
        for e in streamed:
            state[e.param].update({k: like_param(next(tensors), e.param) for k in e.keys})


def like_param(state: Tensor, param: Tensor) -> Tensor:
    """State of a DTensor parameter is a DTensor of the same layout around this rank's
    tensor (on the GPU or in the host slabs); the engine itself works on the local tensor.

    Built as FSDP2 builds its CPU-offloaded shards (``_from_local_no_grad``), not with
    ``DTensor.from_local``: that one moves a host tensor to the mesh's device type, which
    would put offloaded state back on the GPU."""
    if not isinstance(param, DTensor):
        return state
    return dtensor_around(state, param)
