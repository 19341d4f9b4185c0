"""muon-offload: Muon and AdamW whose optimizer state lives in pinned host memory and streams
through the GPU in chunks inside ``step()``, updated by fused Triton kernels."""

from .adamw import AdamW
from .engine import DEFAULT_CHUNK_BYTES
from .engine.interrupt import StepInterrupted
from .muon import Muon
from .param_groups import muon_param_groups

__all__ = ["AdamW", "DEFAULT_CHUNK_BYTES", "Muon", "StepInterrupted", "muon_param_groups"]
__version__ = "0.1.0"
