"""Running one chunk: its state tensors in order, and its units as tasks.

A chunk's state list runs unit by unit, item by item (parameter or segment), key by key: the
order state is allocated in (``state.py``), so neighbours in the list are neighbours in the
host slabs and load as one copy (``scheduler.plan_transfer``).

What a plan fixes is worked out once per plan (``ChunkLayout``: each unit's parameters,
spans and algorithm, a resident chunk's state tensors), so a step only reads what may change
between steps: gradients, and parameters' storage (``p.data = ...`` keeps the plan but not
the views of the old storage).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from torch import Tensor

from ..distributed import DTensor, Mesh, local, run_tasks
from ..kernels._grad_index import GradIndex
from .algorithm import Algorithm, Hyper, UnitJob
from .planner import Chunk, Matrices, MatrixUnit, Unit, unit_params
from .state_format import StateFormat
from .step_work import StepWork

_grad = attrgetter("grad")


@dataclass(frozen=True)
class StepContext:
    """What every chunk of one step reads."""

    state: dict  # the optimizer's state: parameter -> {name: tensor}
    formats: dict  # parameter -> its state's format (state_format.StateFormat)
    work: StepWork  # (group index, parameter) of each planned parameter, as checked
    hypers: Sequence[Hyper]
    steps: Sequence[int]  # each group's step count, this step included
    backend: str
    layouts: Sequence[ChunkLayout]  # one a chunk of the plan
    # Each work item's own step count, this step included (``step_counts.py``).
    counts: Sequence[int] = ()
    # id -> contiguous copy of each parameter that is not contiguous (``StepWork.copied``),
    # made with the context: the kernels and the flat segments update the copy, and
    # ``write_back`` puts it in the parameter when the step ends. None: every one is.
    copies: dict | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.work.copied:  # frozen: set once, here
            params = map(self.work.params.__getitem__, self.work.copied)
            object.__setattr__(self, "copies", {id(p): p.contiguous() for p in params})


def write_back(ctx: StepContext) -> None:
    """Each copy into its parameter, in place (on the caller's stream, which every lane of
    the step has joined by then)."""
    for p in map(ctx.work.params.__getitem__, ctx.work.copied if ctx.copies else ()):
        p.copy_(ctx.copies[id(p)])


Span = slice | Matrices | None  # an item's part of its parameter: flat elements, matrices, all


def unit_items(unit: Unit, work) -> list[tuple[Tensor, Span]]:
    """(parameter, its part: a flat element range, a stack's matrices, or None for the whole)
    of each item of a unit."""
    if isinstance(unit, MatrixUnit):
        return [(work[i][1], unit.piece(k)) for k, i in enumerate(unit.params)]
    return [(work[s.param][1], slice(s.start, s.stop)) for s in unit.segments]


def stack_piece(t: Tensor, piece: Matrices) -> Tensor:
    """Matrices [start, stop) of a contiguous stack ``t`` (``(..., rows, cols)``), as a view of
    shape ``(stop - start, rows, cols)``: updated in place, it updates ``t``."""
    return t.view(-1, *t.shape[-2:])[piece.start : piece.stop]


def _piece_of(t: Tensor, piece: Matrices | None) -> Tensor:
    return t if piece is None else stack_piece(t, piece)


def _part(fmt, name: str, t: Tensor, span: Span) -> Tensor:
    """An item's part of one of its parameter's state tensors."""
    if span is None:
        return t
    if isinstance(span, Matrices):
        return fmt.matrices(name, t, span)
    return fmt.segment(name, t, span)


def chunk_state(state: dict, formats: dict, chunk: Chunk, work) -> list[Tensor]:
    """The local state tensors a chunk updates, in the chunk's order (for each item, its
    tensors in allocation order: key by key, codes then scales for 8-bit state)."""
    out = []
    for unit in chunk.units:
        for p, span in unit_items(unit, work):
            fmt = formats[p]
            out.extend(_part(fmt, name, local(t), span) for name, t in state[p].items())
    return out


@dataclass(frozen=True)
class UnitLayout:
    """One unit as its plan fixes it."""

    unit: Unit
    algorithm: Algorithm
    mesh: Mesh
    params: tuple[Tensor, ...]  # each item's parameter
    spans: tuple[Span, ...]  # each item's part of its parameter (unit_items)
    state_range: tuple[int, int]  # the unit's range in its chunk's state list
    nkeys: int  # state tensors per item: one a key, or codes and scales
    fmt: StateFormat  # the items' state format (a unit's parameters share one)
    plain: bool  # no DTensor among the parameters: local(p) is p
    # A resident unit's state as ``UnitJob.state`` takes it (key by key); None when streamed.
    resident_state: tuple[tuple[Tensor, ...], ...] | None
    # For an algorithm that counts steps per parameter: the work item whose count the unit
    # reads (its first; they all have one count), and the class of that count
    # (``step_counts.step_classes``). None and 0 for the others.
    step_item: int | None = None
    step_class: int = 0
    # ``UnitJob.memo`` of a resident unit: the algorithm's own, for this plan's life.
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def job_state(self, tensors: Sequence[Tensor] | None) -> list[list[Tensor]]:
        """Fresh lists of the unit's state tensors, key by key: from the chunk's staging
        views (streamed), or the resident tensors when ``tensors`` is None."""
        if tensors is None:
            return [list(key) for key in self.resident_state]
        mine = tensors[slice(*self.state_range)]
        return [list(mine[j :: self.nkeys]) for j in range(self.nkeys)]


@dataclass(frozen=True)
class ChunkLayout:
    """One chunk as its plan fixes it. Built once per plan (the optimizer caches both): state
    tensors are created once and written in place (steps, ``load_state_dict``), so the tensors
    listed here stay the state's until a plan is made afresh."""

    chunk: Chunk
    units: tuple[UnitLayout, ...]


def chunk_layout(
    chunk: Chunk,
    state: dict,
    formats: dict,
    work,
    algorithms: dict[str, Algorithm],
    mesh_of: Callable[[int], Mesh],
    classes: Sequence[int] | None = None,
) -> ChunkLayout:
    """``classes``: each work item's step class (``step_counts.step_classes``; None: one)."""
    resident = chunk_state(state, formats, chunk, work) if chunk.resident else None
    units, start = [], 0
    for unit in chunk.units:
        items = unit_items(unit, work)
        algorithm = algorithms[unit.algorithm]
        step_item = unit_params(unit)[0] if algorithm.counts_steps else None
        first = items[0][0]
        nkeys = len(state[first])
        stop = start + len(items) * nkeys
        unit_state = None
        if resident is not None:
            mine = resident[start:stop]
            unit_state = tuple(tuple(mine[j::nkeys]) for j in range(nkeys))
        units.append(
            UnitLayout(
                unit=unit,
                algorithm=algorithm,
                mesh=mesh_of(unit.group),
                params=tuple(p for p, _ in items),
                spans=tuple(span for _, span in items),
                state_range=(start, stop),
                nkeys=nkeys,
                fmt=formats[first],
                plain=not any(isinstance(p, DTensor) for p, _ in items),
                resident_state=unit_state,
                step_item=step_item,
                step_class=0 if step_item is None or classes is None else int(classes[step_item]),
            )
        )
        start = stop
    return ChunkLayout(chunk, tuple(units))


def _job(
    ctx: StepContext,
    u: UnitLayout,
    tensors: Sequence[Tensor] | None,
    scalars: Tensor | None,
    grad_index: GradIndex | None,
    memo: dict | None = None,
) -> UnitJob:
    targets = u.params
    if ctx.copies:  # where the update goes: a copy for a parameter that is not contiguous
        targets = tuple(ctx.copies.get(id(p), p) for p in u.params)
    if u.algorithm.elementwise:
        locals_ = targets if u.plain else [local(p) for p in targets]
        params = [p.view(-1)[span] for p, span in zip(locals_, u.spans, strict=True)]
        grads = [
            local(p.grad).contiguous().view(-1)[span]
            for p, span in zip(u.params, u.spans, strict=True)
        ]
    else:
        params = list(targets)
        # The matrix kernels read gradients as dense rows; a transposed or sliced gradient
        # is copied once (contiguous() is free for the usual contiguous one).
        if ctx.work.plain:  # C-level passes, no local() a gradient
            grads = list(map(Tensor.contiguous, map(_grad, u.params)))
        else:
            grads = [local(p.grad).contiguous() for p in u.params]
        if u.unit.pieces:  # a stack cut at matrix boundaries: the unit's matrices of each
            params = [_piece_of(x, s) for x, s in zip(params, u.spans, strict=True)]
            grads = [_piece_of(g, s) for g, s in zip(grads, u.spans, strict=True)]
    group = u.unit.group
    return UnitJob(
        group=group,
        hyper=ctx.hypers[group],
        step=ctx.steps[group] if u.step_item is None else int(ctx.counts[u.step_item]),
        backend=ctx.backend,
        mesh=u.mesh,
        params=params,
        grads=grads,
        state=u.job_state(tensors),
        fmt=u.fmt,
        scalars=scalars,
        plain=u.plain,
        grad_index=grad_index,
        memo=None if ctx.copies else u.memo if tensors is None else memo,
    )


def run_chunk(
    ctx: StepContext,
    layout: ChunkLayout,
    views: Sequence[Tensor] | None,
    progress: tuple[list[int], list[int]],
    scalars: Sequence[Tensor] | None = None,
    grads: Sequence[GradIndex] | None = None,
    memo: dict | None = None,
) -> None:
    """Run every unit of a chunk on its state (``views``: the staging copies of a streamed
    chunk; None: resident state, updated in place), recording in ``progress`` = (started,
    finished) the index of each unit as it starts and as it finishes. ``scalars``: each
    unit's row of the step's scalar table (Triton path), or None; ``grads``: each unit's
    rows of the step's gradient table (``grad_table.py``), or None; ``memo``: where a streamed
    chunk's units keep what they derive from ``views`` (``StreamScheduler.chunk_memo``, a dict
    a unit), or None. Units run as dion-style tasks, so one unit's collective is in flight
    while the next computes; the planner puts matrix units first, in the same order on every
    rank."""
    units = layout.units
    started, done = progress

    def task(k: int):
        started.append(k)
        unit = units[k]
        row = None if scalars is None else scalars[k]
        index = None if grads is None else grads[k]
        kept = None if memo is None else memo.setdefault(k, {})
        running = unit.algorithm.run(_job(ctx, unit, views, row, index, kept))
        if running is not None:
            yield from running
        done.append(k)

    try:
        run_tasks(task(k) for k in range(len(units)))
    except BaseException:
        if views is not None:
            # The chunk will not be stored: keep what its finished units computed, and the
            # host's (untouched) state for the rest.
            host = chunk_state(ctx.state, ctx.formats, layout.chunk, ctx.work)
            for k in done:
                for j in range(*units[k].state_range):
                    host[j].copy_(views[j])
        raise
