"""The kernels' tuning, as the tools see it: force re-timing, read what the last tuning of a
kernel chose, and where the choices are cached. The tuner itself lives in ``_launch.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from ._launch import TUNER, Config, Tuner


@contextlib.contextmanager
def retuning(enabled: bool = True) -> Iterator[None]:
    """Within the block, every kernel launch re-times its configs even where the cache holds
    a choice (the new winners replace the cached ones)."""
    before = TUNER.retune
    TUNER.retune = enabled
    try:
        yield
    finally:
        TUNER.retune = before


def last_choice(kernel: str) -> tuple[str, float] | None:
    """(config label, its time in ms) that the last tuning or cache hit of ``kernel`` gave in
    this process, or None."""
    last = TUNER.last.get(kernel)
    if not last or "config" not in last:
        return None
    return Config(**last["config"]).label(), float(last.get("ms", float("nan")))


def cache_path(device: torch.device) -> Path:
    """The JSON file holding this GPU's and this Triton's tuning choices."""
    return Tuner.cache_path(device)
