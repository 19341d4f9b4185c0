"""Stepping a unit whose state format has no fused kernels of its algorithm's.

``Algorithm.run`` comes here when the unit's format declares a kernel family
(``StateFormat.kernels``) that the algorithm does not list in ``Algorithm.kernels``: each
item's state is decoded to fp32 scratch on the device (``StateFormat.to_dense``), the
algorithm's dense update runs on it (Triton or torch, as for fp32 state) and the result is
encoded back into the item's tensors in place (``from_dense``). So a new format is one module:
its tensors and its encoding, no kernel. It costs a decode, an fp32 copy of the unit's state
and an encode a step; blocks follow items (a segment starts on a block boundary: the
format's ``align``; a matrix's blocks are its own), so the bits do not depend on chunking.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from .state_format import Dense

SCRATCH = Dense(torch.float32)  # the format the dense update sees


def grouped(job, keys: int) -> list[list[tuple[Tensor, ...]]]:
    """``job.state`` (lists, ``names(key)`` of them a key) as [key][item] -> its tensors."""
    per_key = len(job.state) // keys
    return [
        list(zip(*job.state[k * per_key : (k + 1) * per_key], strict=True)) for k in range(keys)
    ]


def decoded_update(algorithm, job) -> Iterator[None]:
    """Decode, run ``algorithm.update`` on fp32 scratch, encode back (a generator: the
    update's collectives are yielded through)."""
    # The unit's keys (its items share a shape's keys: ``Algorithm.state_shapes``).
    fmt, kinds = job.fmt, [k.kind for k in algorithm.state_shapes(job.params[0].shape)]
    stored = grouped(job, len(kinds))
    dense = [
        [fmt.to_dense(tensors, kind) for tensors in items]
        for items, kind in zip(stored, kinds, strict=True)
    ]
    running = algorithm.update(replace(job, state=dense, fmt=SCRATCH))
    if running is not None:
        yield from running
    for items, values, kind in zip(stored, dense, kinds, strict=True):
        for tensors, x in zip(items, values, strict=True):
            fmt.from_dense(x, kind, tensors)
