"""muon-offload: Muon and AdamW whose optimizer state lives in pinned host memory and streams
through the GPU in chunks inside ``step()``, updated by fused Triton kernels."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import DEFAULT_CHUNK_BYTES
    from .engine.interrupt import StepInterrupted
    from .optim.adamw import AdamW
    from .optim.muon import Muon
    from .optim.param_groups import muon_param_groups

# Each public name and the module that holds it, imported on first use: importing the package
# (as the ``muon-offload`` command does before it parses its arguments) loads no torch.
_HOMES = {
    "AdamW": ".optim.adamw",
    "DEFAULT_CHUNK_BYTES": ".engine",
    "Muon": ".optim.muon",
    "StepInterrupted": ".engine.interrupt",
    "muon_param_groups": ".optim.param_groups",
}
__all__ = ["AdamW", "DEFAULT_CHUNK_BYTES", "Muon", "StepInterrupted", "muon_param_groups"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


# The one place for the version: setuptools reads it as a literal (pyproject.toml), so it stays
# a plain string.
__version__ = "0.1.0"
