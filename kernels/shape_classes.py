"""Size classes of the 2-D products' tuning keys, and the candidates worth timing in a class.

A tuned choice is keyed on the classes of a matrix's dimensions (what selects its tiles), so a
new shape in a known class tunes nothing; the class's sizes are what is timed, so the choice
depends on the class alone, never on which shape of it came first.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._launch import bucket
from .config import Config


def shape_class(n: int) -> int:
    """The class a matrix dimension is tuned in: the next power of two up to 128, then the next
    multiple of 128 (the tiles' sides are 64 to 256, so within a class they cut the matrix
    alike). The bench workloads' dimensions are their own classes."""
    return bucket(n) if n <= 128 else -(-int(n) // 128) * 128


# Below this many rows the persistent TMA kernels of the 2-D products were slower than the
# pointer kernels on the H200 (about 10% faster from the 768 x 2048 class up: docs/design.md),
# so smaller classes do not time them.
TMA_MIN_ROWS = 512


# fitting's answers by (id of the candidates, rows, cols), each beside the candidates it is
# for (kept alive so that their id names them): a launch asks again for the same classes.
_FITTING: dict[tuple, tuple] = {}


def fitting(configs: Sequence[Config], rows: int, cols: int | None = None) -> tuple[Config, ...]:
    """The candidates worth timing for a product whose output tiles cover ``rows`` x ``cols``
    (classes): tiles at most the class's size in each dimension (at least 64, the smallest
    tile), TMA kernels only from TMA_MIN_ROWS rows. Never empty: the smallest-tiled
    candidates are kept when none fits."""
    cols = rows if cols is None else cols
    if not isinstance(configs, tuple):  # a list may change: nothing kept for it
        return _fitting(configs, rows, cols)
    key = (id(configs), rows, cols)
    hit = _FITTING.get(key)
    if hit is not None and hit[0] is configs:
        return hit[1]
    kept = _fitting(configs, rows, cols)
    if len(_FITTING) >= 1024:
        _FITTING.clear()
    _FITTING[key] = (configs, kept)
    return kept


def _fitting(configs: Sequence[Config], rows: int, cols: int) -> tuple[Config, ...]:
    def fits(c: Config) -> bool:
        tile_rows = c.block_m or c.block
        return (
            tile_rows <= max(64, rows)
            and c.block <= max(64, cols)
            and (not c.tma or rows >= TMA_MIN_ROWS)
        )

    kept = tuple(c for c in configs if fits(c))
    if kept:
        return kept
    smallest = min((c.block_m or c.block) * c.block for c in configs)
    return tuple(c for c in configs if (c.block_m or c.block) * c.block == smallest)


# The smallest tile side of the products' candidates.
SMALLEST_TILE = 64


def worth_timing(rows: int, cols: int) -> bool:
    """Whether a product whose output covers ``rows`` x ``cols`` (classes) is worth timing:
    not when one smallest tile covers it. Then each matrix is one program whatever the
    candidate, which differ only in the inner loop's step and warps (microseconds either
    way), and the first fitting candidate is taken untimed, as with tuning off: no timing and
    no compile of the other candidates on a first step."""
    return rows > SMALLEST_TILE or cols > SMALLEST_TILE
