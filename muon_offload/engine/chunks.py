"""Running one chunk: its state tensors in order, and its units as tasks.

A chunk's state list runs unit by unit, item by item (parameter or segment), key by key: the
order state is allocated in (``state.py``), so neighbours in the list are neighbours in the
host slabs and load as one copy (``scheduler.plan_transfer``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from ..distributed import Mesh, local, run_tasks
from ..hyper import Hyper
from .algorithm import Algorithm, UnitJob
from .planner import Chunk, MuonUnit, Unit, unit_params


@dataclass(frozen=True)
class StepContext:
    """What every chunk of one step reads."""

    state: dict  # the optimizer's state: parameter -> {name: tensor}
    formats: dict  # parameter -> its state's format (state_format.Dense / Int8)
    work: list[tuple[int, Tensor]]  # (group index, parameter) of each planned parameter
    hypers: Sequence[Hyper]
    steps: Sequence[int]  # each group's step count, this step included
    algorithms: dict[str, Algorithm]
    backend: str
    mesh_of: Callable[[int], Mesh]


def unit_items(unit: Unit, work) -> list[tuple[Tensor, slice | None]]:
    """(parameter, flat element range, or None for the whole) of each item of a unit."""
    if isinstance(unit, MuonUnit):
        return [(work[i][1], None) for i in unit.params]
    return [(work[s.param][1], slice(s.start, s.stop)) for s in unit.segments]


def chunk_state(state: dict, formats: dict, chunk: Chunk, work) -> list[Tensor]:
    """The local state tensors a chunk updates, in the chunk's order (for each item, its
    tensors in allocation order: key by key, codes then scales for 8-bit state)."""
    out = []
    for unit in chunk.units:
        for p, span in unit_items(unit, work):
            fmt = formats[p]
            for name, t in state[p].items():
                t = local(t)
                out.append(t if span is None else fmt.segment(name, t, span))
    return out


def unit_spans(chunk: Chunk, state: dict, work) -> list[tuple[int, int]]:
    """Each unit's range in the chunk's state list."""
    spans, start = [], 0
    for unit in chunk.units:
        first = work[unit_params(unit)[0]][1]
        count = len(unit_params(unit)) * len(state[first])
        spans.append((start, start + count))
        start += count
    return spans


def _job(ctx: StepContext, unit: Unit, state: list[Tensor]) -> UnitJob:
    algorithm = ctx.algorithms[unit.algorithm]
    items = unit_items(unit, ctx.work)
    first = items[0][0]
    nkeys = len(ctx.state[first])  # tensors per item: one a key, or codes and scales
    if algorithm.elementwise:
        params = [local(p).view(-1)[span] for p, span in items]
        grads = [local(p.grad).contiguous().view(-1)[span] for p, span in items]
    else:
        params = [p for p, _ in items]
        # The matrix kernels read gradients as dense rows; a transposed or sliced gradient
        # is copied once (contiguous() is free for the usual contiguous one).
        grads = [local(p.grad).contiguous() for p, _ in items]
    return UnitJob(
        group=unit.group,
        hyper=ctx.hypers[unit.group],
        step=ctx.steps[unit.group],
        backend=ctx.backend,
        mesh=ctx.mesh_of(unit.group),
        params=params,
        grads=grads,
        state=[state[j::nkeys] for j in range(nkeys)],
        quantized=ctx.formats[first].quantized,
    )


def run_chunk(
    ctx: StepContext,
    chunk: Chunk,
    views: list[Tensor] | None,
    progress: tuple[list[int], list[int]],
) -> None:
    """Run every unit of a chunk on its state (``views``: the staging copies of a streamed
    chunk; None: resident state, updated in place), recording in ``progress`` = (started,
    finished) the index of each unit as it starts and as it finishes. Units run as dion-style
    tasks, so one unit's collective is in flight while the next computes; the planner puts
    matrix units first, in the same order on every rank."""
    tensors = views if views is not None else chunk_state(ctx.state, ctx.formats, chunk, ctx.work)
    spans = unit_spans(chunk, ctx.state, ctx.work)
    started, done = progress

    def task(k: int):
        started.append(k)
        unit = chunk.units[k]
        running = ctx.algorithms[unit.algorithm].update(_job(ctx, unit, tensors[slice(*spans[k])]))
        if running is not None:
            yield from running
        done.append(k)

    try:
        run_tasks(task(k) for k in range(len(chunk.units)))
    except BaseException:
        if views is not None:
            # The chunk will not be stored: keep what its finished units computed, and the
            # host's (untouched) state for the rest.
            host = chunk_state(ctx.state, ctx.formats, chunk, ctx.work)
            for k in done:
                for j in range(*spans[k]):
                    host[j].copy_(views[j])
        raise
