"""The ends of a streamed step: its plan with the matrix chunks at each end halved at matrix
boundaries (``taper``), pure Python like the planner it follows (planner.py).

No update runs before the first streamed chunk's load nor after the last one's store, so
those two transfers are what a step cannot hide (a synchronized loop waits for the store:
the offloaded 8-bit Qwen3-MoE step with 512 MiB chunks ended 3.8 ms after its updates on the
H200, docs/benchmarks.md). Smaller chunks at the ends shrink both; in the middle, full
chunks keep the batches (launches) as large as the budget allows.
"""

from __future__ import annotations

from collections.abc import Sequence

from .planner import Chunk, Matrices, ParamInfo, Plan, holds_matrices, interleave, matrix_unit

# Halving stops at an eighth of the budget, and never below this many plan bytes: a transfer
# that size takes at most 0.3 ms on a PCIe 5 link (fp32 state), less than the extra batches
# cost; the small budgets of the CPU tests are left as packed.
TAPER_FLOOR = 16 << 20


def taper(plan: Plan, params: Sequence[ParamInfo], chunk_bytes: int) -> Plan:
    """``plan`` (``plan_step``'s, of ``params`` with streamed budget ``chunk_bytes``) with its
    streamed matrix chunks tapered at both ends (``taper_ends``) and the element-wise-only
    chunks spread among them again (``planner.interleave``); resident chunks as they were."""
    streamed = [c for c in plan.chunks if not c.resident]
    infos = {p.index: p for p in params}
    matrix = taper_ends([c for c in streamed if holds_matrices(c)], infos, chunk_bytes)
    if len(matrix) == sum(map(holds_matrices, streamed)):
        return plan
    others = [c for c in streamed if not holds_matrices(c)]
    resident = [c for c in plan.chunks if c.resident]
    return Plan((*resident, *interleave(matrix + others)), plan.oversized)


def taper_ends(chunks: list[Chunk], infos: dict, budget: int) -> list[Chunk]:
    """The matrix chunks (streamed, in run order) with those near each end halved at matrix
    boundaries: from the end backwards, a chunk with ``after`` plan bytes of chunks after it
    is halved while it holds ``2 * max(after, floor)`` or more (and more than one matrix;
    ``floor``: an eighth of the budget, at least TAPER_FLOOR); the start is the mirror image
    (``before``). A step of full chunks B so ends ..., B, B/2, B/4, B/8, B/8 and starts B/8,
    B/8, B/4, B/2, B, ...

    Why: no update runs before the first chunk's load nor after the last chunk's store, so
    those transfers are the step's unhidden ends (a synchronized loop waits for the store:
    the offloaded 8-bit Qwen3-MoE step with 512 MiB chunks ended 3.8 ms after its updates).
    The rule keeps every other chunk's store beside updates of at least half its size after
    it (its load, before it), which cover it where the link moves a chunk's state faster
    than half its update takes (8-bit state; fp32 state is bound by the link either way).
    The extra batches are a few at each end. Cut on plan_bytes and matrix counts alone: the
    same chunks on every rank. Each matrix stays in exactly one unit: no result changes."""
    floor = max(TAPER_FLOOR, budget >> 3)

    def shrink(out: list[Chunk], forward: bool) -> list[Chunk]:
        # ``out`` from the end being tapered; ``forward``: that end is the last chunk.
        i, beyond = 0, 0
        while i < len(out) and beyond < budget:
            nbytes = out[i].plan_bytes
            halves = _halve(out[i], infos) if nbytes >= 2 * max(beyond, floor) else None
            if halves is None:
                beyond += nbytes
                i += 1
                continue
            out[i : i + 1] = halves[::-1] if forward else halves  # the outer half first
        return out

    return shrink(shrink(list(chunks)[::-1], True)[::-1], False)


def _halve(chunk: Chunk, infos: dict) -> tuple[Chunk, Chunk] | None:
    """``chunk`` cut at the matrix boundary nearest half its plan bytes (each half keeps at
    least one matrix; a unit cut there becomes two of the same group and algorithm), or None
    where it holds one matrix (or one piece that cannot be cut: a matrix, packed rows)."""
    items = []  # (unit, parameter, its matrices [start, stop) here), in run order
    for u, unit in enumerate(chunk.units):
        for k, index in enumerate(unit.params):
            p, piece = infos[index], unit.piece(k)
            start, stop = (0, p.matrices) if piece is None else (piece.start, piece.stop)
            items.append((u, index, start, stop))
    before = 0
    best = None  # (distance to the target, item, matrix it starts at in the second half)
    for n, (_, index, start, stop) in enumerate(items):
        p = infos[index]
        for j in range(start if n else start + 1, stop):  # a boundary before matrix j
            distance = abs(2 * (before + _share(p, start, j)) - chunk.plan_bytes)
            if best is None or distance < best[0]:
                best = (distance, n, j)
        before += _share(p, start, stop)
    if best is None:
        return None
    _, n, j = best
    u, index, start, stop = items[n]
    first = [*items[:n], (u, index, start, j)] if j > start else items[:n]
    return _rebuild(chunk, first, infos), _rebuild(
        chunk, [(u, index, j, stop), *items[n + 1 :]], infos
    )


def _share(p: ParamInfo, start: int, stop: int) -> int:
    """The plan bytes of matrices [start, stop) of a stack, as ``_pieces`` counts them."""
    return p.plan_bytes * stop // p.matrices - p.plan_bytes * start // p.matrices


def _rebuild(chunk: Chunk, items: list, infos: dict) -> Chunk:
    """A chunk of ``items`` (``_halve``'s), in the units of ``chunk`` that hold them; a piece
    that covers its whole parameter is whole (None)."""
    units = []
    for u, unit in enumerate(chunk.units):
        mine = [(index, a, b) for v, index, a, b in items if v == u]
        if not mine:
            continue
        pieces = [
            (index, None if (a, b) == (0, infos[index].matrices) else Matrices(a, b))
            for index, a, b in mine
        ]
        nbytes = sum(_share(infos[index], a, b) for index, a, b in mine)
        units.append(matrix_unit(unit.group, unit.algorithm, pieces, nbytes))
    return Chunk(tuple(units), sum(x.plan_bytes for x in units), chunk.resident)
