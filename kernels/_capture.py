"""What a CUDA graph capture forbids a launch: allocating, copying from the host, timing
configs. A launch that would need one of them under capture raises ``CaptureMiss`` (the
engine then stays eager)."""

from __future__ import annotations

import torch


class CaptureMiss(RuntimeError):
    """Something that a launch needs was not ready before a CUDA graph capture began."""


def capturing(device: torch.device) -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return (
        device.type == "cuda"
        and torch.cuda.is_initialized()  # nothing captures before CUDA is initialized
        and torch.cuda.is_current_stream_capturing()
    )
