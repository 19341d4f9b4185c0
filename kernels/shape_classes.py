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


def fitting(configs: Sequence[Config], rows: int, cols: int | None = None) -> tuple[Config, ...]:
    """The candidates worth timing for a product whose output tiles cover ``rows`` x ``cols``
    (classes): tiles at most the class's size in each dimension (at least 64, the smallest
    tile), TMA kernels only from TMA_MIN_ROWS rows. Never empty: the smallest-tiled
    candidates are kept when none fits."""
    cols = rows if cols is None else cols

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
