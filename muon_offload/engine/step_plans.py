"""A step's plan (``planner.py``: units and chunks of at most ``chunk_bytes`` of state) with
its chunks' transfers and layouts, and the cache that keeps them while the step's work stays
the same (the same parameters with gradients, shapes, dtypes, algorithms and budgets)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from operator import itemgetter
from typing import TYPE_CHECKING

from ..distributed import DTensor
from .algorithm import Hyper
from .chunks import ChunkLayout, chunk_layout, chunk_state
from .planner import Plan, elementwise_only, plan_step
from .scheduler import Transfer
from .step_counts import split_by_count
from .step_work import StepWork
from .taper import taper
from .transfer import plan_transfers

if TYPE_CHECKING:
    from .settings import LiveSettings
    from .state import StateBuilder

log = logging.getLogger(__name__)


PlanEntry = tuple[Plan, list[Transfer | None], list[ChunkLayout], tuple[bool, ...], StepWork]


class PlanCache(dict[tuple, PlanEntry]):
    """``StepPlanner``'s cache: (plan, transfers, layouts, side, the work planned) by what they
    depend on, and ``last``: the key and entry the last step used, which the next step
    compares its key with first (no hashing it). ``clear()`` forgets both."""

    last: tuple[tuple, PlanEntry] | None = None

    def find(self, key: tuple) -> tuple[tuple, PlanEntry] | None:
        if self.last is None or self.last[0] != key:
            entry = self.get(key)
            self.last = None if entry is None else (key, entry)
        return self.last

    def keep(self, key: tuple, entry: PlanEntry) -> None:
        self[key] = entry
        self.last = (key, entry)

    def clear(self) -> None:
        self.last = None
        super().clear()


class StepPlanner:
    """Plans a step's work (``plan``) and keeps the plans in ``cache`` (``PlanCache``), which
    the state's creation and loading clear."""

    def __init__(self, settings: LiveSettings, states: StateBuilder, cache: PlanCache) -> None:
        self._settings, self._states, self.cache = settings, states, cache
        self._oversized_logged: set = set()  # the parameters named in a notice already

    def plan(self, state, work: StepWork, hypers: Sequence[Hyper], classes, placement, mesh_of):
        """The plan, the chunks' transfers and layouts, and which chunks the scheduler may run
        on its side lane (the element-wise-only ones) for this step's work: cached while the
        work (its parameters, their groups, shapes and dtypes), the groups' algorithms and
        layouts, the step classes (``step_counts.step_classes``) and the budgets stay the
        same, and while state is neither created nor loaded (which clear the cache).
        ``placement`` and ``mesh_of``: the optimizer's, read while planning."""
        settings, store, states = self._settings.now, self._states.store, self._states
        key = (
            which(work),
            work.shapes,  # read by the step's checks (``StepWork``)
            work.dtypes,
            work.grad_dtypes,  # matrices batch by gradient dtype too (``StateBuilder.param_info``)
            tuple((h.algorithm, h.flatten, h.split_sizes, h.num_heads) for h in hypers),
            settings.chunk_bytes,
            settings.resident_chunk_bytes,
            settings.tapers,
            classes,
        )
        found = self.cache.find(key)
        if found is not None:
            # The equal tuples of the key found: the graph's key compares them as one object.
            work.shapes, work.dtypes = found[0][1], found[0][2]
            return found[1][:4]
        states.check_fits(state, work, hypers)  # state of the shapes the algorithm gives
        infos = [
            states.param_info(i, gi, p, hypers[gi], p not in store.streamed, placement, grad_dtype)
            for i, ((gi, p), grad_dtype) in enumerate(zip(work, work.grad_dtypes, strict=True))
        ]
        infos = split_by_count(infos, classes)  # a unit's parameters share one step count
        plan = plan_step(
            infos,
            settings.chunk_bytes,
            settings.resident_chunk_bytes,
            settings.elementwise_chunk_bytes,
        )
        if settings.tapers and _on_one_rank(work, mesh_of):
            plan = taper(plan, infos, settings.chunk_bytes)  # the ends of the streamed step
        oversized = [work[i] for i in plan.oversized]
        _say_oversized(oversized, self._oversized_logged, settings.chunk_bytes)
        transfers = _transfers(plan, state, store, work)
        fixed = (state, store.formats, work, states.algorithms, mesh_of, classes)
        layouts = [chunk_layout(c, *fixed) for c in plan.chunks]
        side = elementwise_only(plan)
        self.cache.keep(key, (plan, transfers, layouts, side, work.pairs_only()))
        return plan, transfers, layouts, side


def _on_one_rank(work: StepWork, mesh_of) -> bool:
    """Whether no parameter of the step lives on a mesh of several ranks. Steps that do keep
    their ends (taper.py): each unit there issues collectives, which more, smaller units
    would multiply, and their steps run eagerly unless ``cuda_graph=True`` (capture_rules.py:
    a graph across processes only when asked for)."""
    return all(mesh_of(gi).size == 1 and not isinstance(p, DTensor) for gi, p in work)


def _say_oversized(oversized: list, logged: set, chunk_bytes: int) -> None:
    """One notice a plan for the (group, parameter) pairs in ``oversized`` not yet named in
    ``logged`` (not one a matrix: a dense model has dozens); they join ``logged``."""
    new = [(gi, p) for gi, p in oversized if p not in logged]
    if new:
        logged.update(p for _, p in new)
        shapes = Counter((gi, tuple(p.shape)) for gi, p in new)
        which = ", ".join(f"param group {g}: {s} x {n}" for (g, s), n in shapes.items())
        log.warning(
            "%d parameters have more state than chunk_bytes=%d in a piece that cannot be cut"
            " (a matrix, or a stack kept whole; Muon state counts at fp32 width at least); each"
            " such piece is streamed as a chunk of its own: %s",
            *(len(new), chunk_bytes, which),
        )


def _transfers(plan, state, store, work: StepWork) -> list:
    """Per chunk of ``plan``, its state's host-device transfers; None for a resident chunk.
    No chunk's runs span another's bytes (``plan_transfers``)."""
    chunks = [
        None if chunk.resident else chunk_state(state, store.formats, chunk, work)
        for chunk in plan.chunks
    ]
    streamed = any(c is not None for c in chunks)
    return plan_transfers(chunks, store.host.slab_of) if streamed else chunks


def which(work: StepWork) -> tuple:
    """(group indices, parameter ids) of the step's pairs: the plan key's part naming them."""
    if work.which is None:  # kept with pairs that a later step reuses (``step_work``)
        # The plan holds ``work``: an id is not reused meanwhile.
        work.which = (tuple(map(itemgetter(0), work)), tuple(map(id, work.params)))
    return work.which
