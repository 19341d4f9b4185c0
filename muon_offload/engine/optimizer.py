"""``ChunkedOptimizer``: the engine under ``Muon`` and ``AdamW``.

A step runs in four stages:
1. read and check every group and gradient (nothing is touched before this passes);
2. create missing state (``state.py``): in pinned host slabs (offloaded) or beside the
   parameters (resident), in the planner's order so each chunk's state is mostly one range;
3. plan (``planner.py``): units and chunks of at most ``chunk_bytes`` of state (cached while
   the set of parameters with gradients stays the same);
4. run the chunks through the scheduler (``scheduler.py``): load, let each unit's algorithm
   update it, store back; the element-wise-only chunks on the scheduler's side lane. An
   exception becomes ``StepInterrupted`` (``interrupt.py``).

Subclasses name their algorithms (``algorithms``: group ``algorithm`` -> ``Algorithm``) and
say how a group reads (``_read_hyper``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from operator import itemgetter

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..distributed import (
    Mesh,
    Placement,
    StepAgreements,
    check_ranks_agree,
    local,
    placement_of,
    resolve_mesh,
)
from . import capture_rules, first_compile
from .algorithm import Algorithm, Hyper, common_backends
from .checkpoint import CheckpointMixin
from .chunks import ChunkLayout, StepContext, chunk_layout, chunk_state, run_chunk, write_back
from .delegated import Delegated
from .grad_table import GradTable, grad_table
from .graph_runner import GraphRunner
from .group_checks import check_param_dtypes, check_unique_params, listed_params
from .interrupt import interrupted
from .introspect import Tools
from .planner import ParamInfo, Plan, elementwise_only, plan_step
from .prefetch import Prefetcher
from .scalars import ScalarTable, scalar_table
from .scheduler import Transfer
from .settings import LiveSettings, Setting, Settings
from .sharded_scales import HandedScales
from .state import StateMixin, StateStore
from .step_counts import StepCounts, split_by_count
from .step_work import StepWork, step_work
from .streams import Streams
from .transfer import plan_transfers

log = logging.getLogger(__name__)

LOCAL_PLACEMENT = Placement("local")  # element-wise parameters: no communication


PlanEntry = tuple[Plan, list[Transfer | None], list[ChunkLayout], tuple[bool, ...], StepWork]


class PlanCache(dict[tuple, PlanEntry]):
    """``_plan``'s cache: (plan, transfers, layouts, side, the work planned) by what they
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


class ChunkedOptimizer(StateMixin, CheckpointMixin, Optimizer):
    """Base class of the chunked, optionally offloaded, optimizers."""

    # The group's ``algorithm`` -> its per-unit update (and state keys).
    algorithms: dict[str, Algorithm] = {}

    # The settings it was built with, as attributes (``prefetch`` is the method; its setting
    # is ``Settings.prefetch``); assigned, checked as the constructor's were.
    offload = Setting()
    chunk_bytes = Setting()
    resident_chunk_bytes = Setting()
    resident_bytes = Setting()
    state_dtype = Setting()
    backend = Setting()
    cuda_graph = Setting()

    # What tools read, and new chunk budgets (``introspect.Tools``).
    host_state_bytes = Delegated("_tools", Tools.host_state_bytes)
    host_buffers = Delegated("_tools", Tools.host_buffers)
    staging_bytes = Delegated("_tools", Tools.staging_bytes)
    timeline = Delegated("_tools", Tools.timeline)
    reconfigure = Delegated("_tools", Tools.reconfigure)
    prefetch = Delegated("_prefetcher", Prefetcher.prefetch)
    graph_stats = Delegated("_graphing", GraphRunner.stats)

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        distributed_mesh=None,
        **settings,  # offload, chunk_bytes, ...: Settings.check's, with its defaults
    ):
        settings = Settings.check(**settings, backends=common_backends(self.algorithms.values()))
        mesh = resolve_mesh(distributed_mesh)
        capture_rules.check_settings(settings, mesh.group, self.algorithms.values())
        # As torch's optimizers: the hyper-parameters are checked before params is read.
        self._read_hyper(dict(defaults, params=[]), None)
        self._setup(settings, mesh)
        self._constructed = False
        super().__init__(params, defaults)
        _groups_added(self)
        self._constructed = True
        first_compile.prestart(self)  # the first step's compile workers, starting meanwhile

    def _setup(self, settings: Settings, mesh: Mesh) -> None:
        """The engine's own attributes: settings, and nothing built yet."""
        self._mesh = mesh
        self._group_meshes: dict[int, Mesh] = {}
        self._agreements = StepAgreements()  # filled in __init__ and add_param_group
        # Read as attributes (opt.chunk_bytes, ...), and by the collaborators, as they are now.
        self._settings = LiveSettings(settings, common_backends(self.algorithms.values()))
        # (plan, transfers, layouts, side, the work planned) by what they depend on (``_plan``);
        # cleared whenever state is created or loaded and when the budgets change.
        self._plans = PlanCache()
        self._store = StateStore()
        self._streams = Streams(self._store)  # the scheduler, made for the step's device
        self._tools = Tools(self._store, self._streams, self._settings, self._plans)
        self._counts = StepCounts()  # each parameter's count of the steps that updated it
        self._handed_scales = HandedScales()  # 8-bit rows state_dict() copied (sharded_scales)
        # cuda_graph: eager, or captured and replayed; "auto" stays eager on a gloo mesh.
        blocker = capture_rules.mesh_blocker(mesh.group)
        self._graphing = GraphRunner(self._settings, self._streams, self.algorithms, blocker)
        parts = (self._streams, self._plans, self._store, self._handed_scales, self._graphing)
        self._prefetcher = Prefetcher(self._settings, *parts)  # and its backward hooks
        self._policy = self.state_policy(settings.state_dtype)
        self._scalars: ScalarTable | None = None  # the step's scalar table (Triton path)
        self._grad_table: GradTable | None = None  # the step's gradient addresses (Triton path)
        self._oversized_logged: set[Tensor] = set()
        self._cpu_notice_given = False

    # ----------------------------------------------------------------- groups

    def _read_hyper(self, group: dict, index: int) -> Hyper:
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        # A group's own mesh (MoE experts sharded over another mesh than attention) is kept
        # beside the group, not in it: a group dict goes into state_dict(), a mesh must not.
        param_group = dict(param_group)
        group_mesh = param_group.pop("distributed_mesh", None)
        if "params" in param_group:  # a group without them: torch raises its own error
            param_group["params"] = listed_params(param_group["params"])
            index = len(self.param_groups)
            check_unique_params(param_group["params"], self.param_groups, index)
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            if group_mesh is not None:
                self._group_meshes[index] = resolve_mesh(group_mesh)
            group, mesh_group = self.param_groups[index], self._mesh_of(index).group
            if self.cuda_graph is True:
                capture_rules.check_group(group, index, mesh_group)
            hyper = self._read_hyper(group, index)
            check_param_dtypes(group, index)
            self._check_quantizable(index)
            for p in group["params"]:
                self._placement(index, p, hyper)
            if self._constructed:
                _groups_added(self)
        except Exception:
            self.param_groups.pop()
            self._group_meshes.pop(index, None)
            raise
        graphing = self._graphing
        graphing.blocker = graphing.blocker or capture_rules.group_blocker(group, mesh_group)

    def _mesh_of(self, group_index: int) -> Mesh:
        return self._group_meshes.get(group_index, self._mesh)

    def _params(self) -> list[tuple[int, Tensor]]:
        return [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]

    def _placement(self, gi: int, param: Tensor, hyper: Hyper) -> Placement:
        if self.algorithms[hyper.algorithm].elementwise:
            return LOCAL_PLACEMENT
        where = f"param group {gi} (parameter of shape {tuple(param.shape)})"
        return placement_of(param, self._mesh_of(gi), hyper.flatten, where, hyper.num_heads)

    # ------------------------------------------------------------------ state

    def _param_info(self, index, group, p: Tensor, hyper: Hyper, resident, grad_dtype=None):
        # A batch of matrices is one launch reading one gradient dtype (None: placing state).
        fmt = self._format(p)
        return ParamInfo(
            index=index,
            group=group,
            algorithm=hyper.algorithm,
            elementwise=self.algorithms[hyper.algorithm].elementwise,
            numel=local(p).numel(),
            plan_bytes=self._budget_bytes(p, hyper),
            batch_key=(tuple(p.shape), p.dtype, grad_dtype, fmt, self._placement(group, p, hyper)),
            resident=resident,
            align=fmt.align,
            unit_key=fmt,
            matrices=self._cut_matrices(group, p, hyper),
        )

    # --------------------------------------------------------------- planning

    def _plan(self, work: StepWork, hypers: Sequence[Hyper], classes=None):
        """The plan, the chunks' transfers and layouts, and which chunks the scheduler may run
        on its side lane (the element-wise-only ones) for this step's work: cached while the
        work (its parameters, their groups, shapes and dtypes), the groups' algorithms and
        layouts, the step classes (``step_counts.step_classes``) and the budgets stay the
        same, and while state is neither created nor loaded (which clear the cache)."""
        key = (
            _which(work),
            work.shapes,  # read by the step's checks (``StepWork``)
            work.dtypes,
            work.grad_dtypes,  # matrices batch by gradient dtype too (``_param_info``)
            tuple((h.algorithm, h.flatten, h.split_sizes, h.num_heads) for h in hypers),
            self.chunk_bytes,
            self.resident_chunk_bytes,
            classes,
        )
        found = self._plans.find(key)
        if found is not None:
            # The equal tuples of the key found: the graph's key compares them as one object.
            work.shapes, work.dtypes = found[0][1], found[0][2]
            return found[1][:4]
        self._check_fits(work, hypers)  # state of the shapes the algorithm gives
        infos = [
            self._param_info(i, gi, p, hypers[gi], p not in self._store.streamed, grad_dtype)
            for i, ((gi, p), grad_dtype) in enumerate(zip(work, work.grad_dtypes, strict=True))
        ]
        infos = split_by_count(infos, classes)  # a unit's parameters share one step count
        plan = plan_step(infos, self.chunk_bytes, self.resident_chunk_bytes)
        _say_oversized([work[i] for i in plan.oversized], self._oversized_logged, self.chunk_bytes)
        transfers = _transfers(plan, self.state, self._store, work)
        fixed = (self.state, self._store.formats, work, self.algorithms, self._mesh_of, classes)
        layouts = [chunk_layout(c, *fixed) for c in plan.chunks]
        side = elementwise_only(plan)
        self._plans.keep(key, (plan, transfers, layouts, side, work.pairs_only()))
        return plan, transfers, layouts, side

    # ------------------------------------------------------------------- step

    def _check_step(self) -> tuple[list[Hyper], StepWork, torch.device | None]:
        hypers = [self._read_hyper(g, i) for i, g in enumerate(self.param_groups)]
        last = self._plans.last  # its pairs, reused if the same parameters step again
        # The gradient table and the graph's key (if the last step made them) read pointers
        # with the checks.
        graphed = self._graphing.graphs is not None and self._graphing.graphs.off is None
        keyed = graphed or self._grad_table is not None
        work, device = step_work(self.param_groups, last and last[1][4], keyed)
        if device is not None and self.offload and device.type != "cuda":
            if torch.cuda.is_available():
                raise ValueError(
                    f"offload=True streams state to a CUDA device, but the parameters are on "
                    f"{device}; move the model to the GPU first"
                )
            if not self._cpu_notice_given:
                log.warning("offload=True without CUDA: running the chunked pipeline on the CPU")
                self._cpu_notice_given = True
        return hypers, work, device

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if self.cuda_graph is True and closure is not None:
            raise ValueError("cuda_graph=True takes no closure: run it before step()")
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hypers, work, device = self._check_step()
        capture_rules.check_device(self.cuda_graph, device)
        # Every rank of a mesh steps the same parameters (one CPU all-reduce per mesh).
        self._agreements.check(self.param_groups, self._mesh_of)
        if not work:
            for group in self.param_groups:
                group["step"] += 1
            return loss
        # State and plan first: a failure there (pinned memory, a bad parameter) leaves the
        # step count as it was.
        self._step_state(hypers, work, device)
        counted = [self.algorithms[h.algorithm].counts_steps for h in hypers]
        slots, counts, classes = self._counts.for_step(_which(work), work.params, counted)
        plan, transfers, layouts, side = self._plan(work, hypers, classes)
        self._streams.for_step(device)
        steps = [g["step"] + 1 for g in self.param_groups]
        # The kernels' scalars (this step's counts) on the device, before the counts advance.
        self._scalars = scalar_table(self._scalars, self.algorithms, self.backend, device)
        rows = self._scalars and self._scalars.write(layouts, hypers, steps, counts)
        self._grad_table = grad_table(self._grad_table, self.algorithms, self.backend, device)
        grad_rows = self._grad_table and self._grad_table.write(layouts, hypers, work)
        for group in self.param_groups:
            group["step"] += 1
        unstep = self._counts.advance(slots, counts)  # each stepped parameter's count
        progress = [([], []) for _ in plan.chunks]  # (started, finished) units, per chunk
        ctx = StepContext(
            self.state, self._store.formats, work, hypers, steps, self.backend, layouts, counts
        )

        def update(i: int, views: Sequence[Tensor] | None) -> None:
            run_chunk(
                ctx, layouts[i], views, progress[i], rows and rows[i], grad_rows and grad_rows[i]
            )

        try:
            first_compile.before(self, ctx, layouts, rows, device)  # new kernels: in parallel
            # Maybe a graph; "auto" runs a step with a closure eagerly (the closure's work and
            # the step's are the user's to order, not a graph's).
            tables = (self._scalars, self._grad_table)
            closed = closure is not None
            self._graphing.run(
                work, layouts, hypers, transfers, update, side, closed, self.state, tables
            )
        except BaseException as err:
            report = interrupted(plan, work, progress, err, self.param_groups, unstep)
            if isinstance(err, Exception):
                raise report from err
            err.step_interrupted = report  # KeyboardInterrupt stays a KeyboardInterrupt
            if hasattr(err, "add_note"):
                err.add_note(str(report))
            raise
        finally:
            write_back(ctx)  # what the step updated, also when it stopped part-way
        return loss


def _groups_added(opt: ChunkedOptimizer) -> None:
    """After construction or ``add_param_group``: the ranks of each mesh hold the same groups
    (checked now, and each step: ``StepAgreements``), and every parameter has its state, as
    dion's Muon makes it (``state.py``: ``state_dict()`` holds every key before any step)."""
    check_ranks_agree(opt.param_groups, opt._mesh_of)
    opt._agreements.add(opt.param_groups, opt._mesh_of)
    opt._ensure_state(opt._hypers())
    opt._prefetcher.hook(p for _, p in opt._params())


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


def _which(work: StepWork) -> tuple:
    """(group indices, parameter ids) of the step's pairs: the plan key's part naming them."""
    if work.which is None:  # kept with pairs that a later step reuses (``step_work``)
        # The plan holds ``work``: an id is not reused meanwhile.
        work.which = (tuple(map(itemgetter(0), work)), tuple(map(id, work.params)))
    return work.which
