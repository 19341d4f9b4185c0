"""TMA (Hopper's tensor memory accelerator) helpers for the persistent product kernels of
``gram_tma.py`` and ``poly_apply.py``: which layouts a descriptor can describe, the
descriptors themselves, and the persistent grid. Nothing here touches a device at import.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from ._launch import FP_FUSION, Config, Memo


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_grid(items: int, config: Config, device: torch.device) -> int:
    """Programs of a persistent kernel: one per work item, at most ``programs_per_sm`` per SM
    (132 SMs, an H100/H200's, off CUDA: the compile check records launches on the CPU). The
    grid only deals the items out; a matrix's bits do not depend on it."""
    sms = _sm_count(device.index) if device.type == "cuda" else 132
    return max(1, min(items, sms * config.programs_per_sm))


def persistent_options(config: Config) -> dict:
    """A persistent TMA kernel's loop and launch options (``gram_tma``'s and
    ``poly_apply_tma``'s kernels take the same)."""
    return dict(
        FLATTEN=config.flatten,
        WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=FP_FUSION,
    )


def tma_enabled(device: torch.device) -> bool:
    """Whether the TMA configs join the candidates on ``device``: ``MUON_OFFLOAD_TMA=1`` yes,
    ``0`` no; unset, yes on a GPU that has TMA (compute capability 9.0 and up: Hopper,
    Blackwell), never on the CPU. On the H200 (triton 3.6, docs/benchmarks.md)
    they made the eager resident qwen3 step 6% faster (0.1435 -> 0.1343 s) and left the
    offloaded one as it was (0.3281 -> 0.3251 s): their launches cost the host more (the
    offloaded step's host time 0.172 -> 0.212 s), which the step hid. Read per call, not at
    import (nothing here touches a device before a launch asks)."""
    switch = os.environ.get("MUON_OFFLOAD_TMA")
    if switch is not None:
        return switch == "1"
    return device.type == "cuda" and _capability(device.index)[0] >= 9


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


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


# Descriptors' fields by what they are made of (dtype, shape, strides, box, the base's
# alignment), without their base: ``TensorDescriptor`` validates its fields at construction
# (alignment, strides, box), which a steady step's ~800 descriptors did again for the same
# shapes. The base tensor is never held here (it would keep its memory alive).
_DESCRIPTORS = Memo()


def descriptor_template(t: Tensor, transposed: bool, block: tuple[int, int]) -> tuple:
    """``tensor_descriptor``'s validated fields for t's layout: (class, fields without the
    base), for ``from_template`` with a tensor of that layout."""
    key = (t.dtype, t.shape, t.stride(), transposed, block, t.data_ptr() % 16)
    template = _DESCRIPTORS.get(key)
    if template is None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        made = TensorDescriptor.from_tensor(t.mT if transposed else t, [1, *block])
        template = _DESCRIPTORS.put(key, (type(made), {**vars(made), "base": None}))
    return template


def from_template(template: tuple, base: Tensor):
    """A descriptor of ``template``'s fields on ``base`` (``t.mT`` where it was transposed),
    built without validating them again."""
    cls, fields = template
    made = object.__new__(cls)
    made.__dict__.update(fields)
    made.base = base
    return made


def tensor_descriptor(t: Tensor, transposed: bool, block: tuple[int, int]):
    """A host TMA descriptor of t [B, R, C] as laid out (of ``t.mT`` when ``transposed``), its
    box [1, *block] in that physical order. A host object, passed by value at launch: nothing
    is allocated on the device, so launches with it can be captured in a CUDA graph."""
    template = descriptor_template(t, transposed, block)
    return from_template(template, t.mT if transposed else t)
