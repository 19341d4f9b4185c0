"""The tuning tables shipped with the package, in the format ``muon-offload tune`` writes
(``tuned/tune-<GPU name>-triton<version>.json``), for the GPUs and Triton versions they were
measured on. A key the user's cache lacks takes the table's decision for its class, else for
the nearest class of the same kernel and other fields, untimed: on such a GPU a first step
compiles only the configs it runs."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path

# The tables shipped with the package: ``tune-<GPU name>-triton<version>.json``, as
# ``muon-offload tune`` writes them.
SHIPPED_DIR = Path(__file__).with_name("tuned")


def _size_fields(name: str) -> tuple[str, tuple[str, ...], tuple[float, ...]] | None:
    """A cache key split into (kernel, its other fields, log2 of its size fields)."""
    kernel, *fields = name.split("|")
    sizes = tuple(math.log2(int(f)) for f in fields if f.isdigit() and int(f) > 0)
    others = tuple("#" if f.isdigit() else f for f in fields)
    return kernel, others, sizes


class ShippedTables:
    """The shipped tables, each read once, when first asked for."""

    def __init__(self) -> None:
        self._tables: dict[str, dict[str, dict]] = {}  # file name -> its table

    def _table(self, file_name: str) -> dict[str, dict]:
        table = self._tables.get(file_name)
        if table is None:
            table = {}
            with contextlib.suppress(OSError, ValueError):
                table = json.loads((SHIPPED_DIR / file_name).read_text())
            self._tables[file_name] = table
        return table

    def choice(self, file_name: str, name: str, pick: Callable[[dict], object | None]):
        """The entry for key ``name``'s class, else for the nearest class of the same kernel
        and other fields, whose config ``pick`` accepts (a candidate here): (entry, config),
        or None. Nearest: the least sum of log2 distances of the size fields, ties to the
        smaller name, so the choice depends on the key and the table alone."""
        table = self._table(file_name)
        if not table:
            return None
        entry = table.get(name)
        config = pick(entry) if entry else None
        if config is not None:
            return entry, config
        kernel, others, sizes = _size_fields(name)
        best = None
        for other, entry in table.items():
            o_kernel, o_others, o_sizes = _size_fields(other)
            if (o_kernel, o_others) != (kernel, others) or len(o_sizes) != len(sizes):
                continue
            config = pick(entry)
            if config is None:
                continue
            distance = sum(abs(a - b) for a, b in zip(sizes, o_sizes, strict=True))
            if best is None or (distance, other) < best[:2]:
                best = (distance, other, entry, config)
        return None if best is None else best[2:]
