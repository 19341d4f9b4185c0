"""TMA (Hopper's tensor memory accelerator) helpers for the persistent product kernels of
``gram_tma.py`` and ``poly_apply.py``: which layouts a descriptor can describe, the
descriptors themselves, and the persistent grid. Nothing here touches a device at import.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from ._launch import Config


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_grid(items: int, config: Config, device: torch.device) -> int:
    """Programs of a persistent kernel: one per work item, at most ``programs_per_sm`` per SM
    (132 SMs, an H100/H200's, off CUDA: the compile check records launches on the CPU). The
    grid only deals the items out; a matrix's bits do not depend on it."""
    sms = _sm_count(device.index) if device.type == "cuda" else 132
    return max(1, min(items, sms * config.programs_per_sm))


def tma_enabled() -> bool:
    """``MUON_OFFLOAD_TMA=1`` adds the TMA configs to the candidates; off by default. Why: on
    the H200 (triton 3.6) the TMA products are ~10% faster on the GPU, but each of their
    launches costs the host ~0.1 ms more (descriptors built at launch): the eager resident
    qwen3 step's host time went 0.053 -> 0.111 s, and the eager offloaded one, which issues
    ~16 times the launches and waits on the host, went 0.351 -> 0.368 s (docs/benchmarks.md,
    session 7). On until that cost is gone, it would slow the default (eager, offloaded) step;
    with ``cuda_graph=True`` or a GPU-bound resident step, opt in."""
    return os.environ.get("MUON_OFFLOAD_TMA", "0") == "1"


def tma_layout(t: Tensor) -> bool | None:
    """For a 16-bit [B, R, C] tensor that a TMA descriptor can describe: False when rows are
    contiguous, True for a transposed view (columns contiguous, the descriptor is made on
    ``t.mT``); None when TMA cannot read it (another dtype, a base not 16-byte aligned, a
    stride not a multiple of 16 bytes). From the layout only, never the batch size."""
    if t.dtype not in (torch.bfloat16, torch.float16) or t.data_ptr() % 16:
        return None
    stride_b, stride_r, stride_c = t.stride()
    if stride_c == 1:
        inner, transposed = stride_r, False
    elif stride_r == 1:
        inner, transposed = stride_c, True
    else:
        return None
    if inner <= 0 or inner % 8 or stride_b <= 0 or stride_b % 8:  # 8 elements = 16 bytes
        return None
    return transposed


def tensor_descriptor(t: Tensor, transposed: bool, block: tuple[int, int]):
    """A host TMA descriptor of t [B, R, C] as laid out (of ``t.mT`` when ``transposed``), its
    box [1, *block] in that physical order. A host object, passed by value at launch: nothing
    is allocated on the device, so launches with it can be captured in a CUDA graph."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t.mT if transposed else t, [1, *block])
