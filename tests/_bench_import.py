"""The bench scripts as modules for tests: imported from bench/ with this process's
TORCHDYNAMO_DISABLE kept. The scripts set it when imported (their runs are eager), and
torch._dynamo reads it when first imported, which may happen before conftest puts it back
after collection: torch.compile elsewhere in the worker would return the module itself, and
dion would run uncompiled."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def import_bench(*names: str) -> tuple:
    """The modules ``names`` of bench/, imported in order."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    kept = os.environ.get("TORCHDYNAMO_DISABLE")
    try:
        return tuple(importlib.import_module(name) for name in names)
    finally:
        if kept is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = kept
