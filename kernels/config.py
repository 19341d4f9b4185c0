"""A kernel launch configuration: what the tuner chooses among and caches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    """A launch configuration. ``block`` elements per tile; ``chunk`` elements per program
    (multi-tensor kernels) or ``block_m`` x ``block`` tiles (2-D kernels)."""

    block: int
    chunk: int = 0
    block_m: int = 0
    num_warps: int = 4
    num_stages: int = 1
    # The persistent TMA kernels of the 2-D products (16-bit layouts that TMA accepts,
    # ``tma_layout``): ``programs_per_sm`` sizes their grid, ``flatten`` and
    # ``warp_specialize`` are the ``tl.range`` options of their loop over (matrix, tile) items.
    tma: bool = False
    programs_per_sm: int = 1
    flatten: bool = False
    warp_specialize: bool = False

    def label(self) -> str:
        parts = [f"block={self.block}"]
        if self.chunk:
            parts.append(f"chunk={self.chunk}")
        if self.block_m:
            parts.append(f"block_m={self.block_m}")
        parts.append(f"warps={self.num_warps}")
        if self.num_stages != 1:  # configs that differ only in stages must not share a label
            parts.append(f"stages={self.num_stages}")
        if self.tma:
            parts.append(f"tma x{self.programs_per_sm}/sm")
            parts += ["flatten"] * self.flatten + ["ws"] * self.warp_specialize
        return " ".join(parts)


def chunked(*rows: tuple[int, int, int]) -> tuple[Config, ...]:
    """The candidates of a kernel whose programs each cover ``chunk`` elements in tiles of
    ``block`` (the element-wise, 8-bit and normalization kernels), from (block, chunk,
    num_warps) rows. Each chunk must be a whole number of tiles: the normalization's
    unmasked loop steps through its chunk a tile at a time."""
    for block, chunk, _ in rows:
        if chunk % block:
            raise ValueError(f"chunk {chunk} is not a multiple of block {block}")
    return tuple(Config(block=b, chunk=c, num_warps=w) for b, c, w in rows)
