"""``ChunkedOptimizer``: the engine under ``Muon`` and ``AdamW``.

A step runs in four stages:
1. read and check every group and gradient (nothing is touched before this passes);
2. create missing state (``state.py``): in pinned host slabs (offloaded) or beside the
   parameters (resident), in the planner's order so each chunk's state is mostly one range;
3. plan (``planner.py``, ``step_plans.py``): units and chunks of at most ``chunk_bytes`` of
   state (cached while the set of parameters with gradients stays the same);
4. run the chunks through the scheduler (``scheduler.py``): load, let each unit's algorithm
   update it, store back; the element-wise-only chunks on the scheduler's side lane. An
   exception becomes ``StepInterrupted`` (``interrupt.py``).

Subclasses name their algorithms (``algorithms``: group ``algorithm`` -> ``Algorithm``) and
say how a group reads (``_read_hyper``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..distributed import (
    Mesh,
    Placement,
    StepAgreements,
    check_ranks_agree,
    resolve_mesh,
)
from . import capture_rules, first_compile
from .algorithm import Algorithm, Hyper, common_backends
from .checkpoint import Checkpoints, restore_copy
from .chunks import StepContext, run_chunk, write_back
from .delegated import Delegated
from .grad_table import GradTable, grad_table
from .graph_runner import GraphRunner
from .group_checks import check_param_dtypes, check_unique_params, listed_params
from .interrupt import interrupted
from .introspect import Tools
from .prefetch import Prefetcher
from .scalars import ScalarTable, scalar_table
from .settings import LiveSettings, Setting, Settings
from .sharded_scales import HandedScales
from .state import StateBuilder, StateStore, group_pairs
from .state_format import StatePolicy
from .step_counts import StepCounts
from .step_plans import PlanCache, StepPlanner, which
from .step_work import StepWork, step_work
from .streams import SettledState, Streams

log = logging.getLogger(__name__)


class ChunkedOptimizer(Optimizer):
    """Base class of the chunked, optionally offloaded, optimizers.

    It holds its parts (``_setup``): the settings as they are now, the state store and its
    builder (``StateBuilder``), the step planner and its cache, the scheduler (``Streams``),
    the CUDA graphs (``GraphRunner``), the prefetch hooks (``Prefetcher``), the checkpoint
    reader and writer (``Checkpoints``) and what tools read (``Tools``). A public method of
    one of them is the optimizer's of that name (``Delegated``)."""

    # The group's ``algorithm`` -> its per-unit update (and state keys).
    algorithms: dict[str, Algorithm] = {}
    # Each parameter's state format; a subclass may name another policy (docs/design.md).
    state_policy = StatePolicy
    # The state dict key of a parameter's step count: torch's AdamW ``step`` (``Muon``: dion's).
    step_count_key = "step"

    # The settings it was built with, as attributes (``prefetch`` is the method; its setting
    # is ``Settings.prefetch``); assigned, checked as the constructor's were. Those the state
    # is made by (where it lives, its format) are fixed: assigning one raises.
    offload = Setting(fixed=True)
    chunk_bytes = Setting()
    resident_chunk_bytes = Setting()
    resident_bytes = Setting(fixed=True)
    state_dtype = Setting(fixed=True)
    backend = Setting()
    cuda_graph = Setting()
    prefetch_bytes = Setting()

    # torch's ``Optimizer.state``, read after a replay's held stores (the step's: ``_state``).
    state, _state = SettledState(), property(SettledState.held)

    # What tools read, and new chunk budgets (``introspect.Tools``).
    host_state_bytes = Delegated("_tools", Tools.host_state_bytes)
    host_buffers = Delegated("_tools", Tools.host_buffers)
    staging_bytes = Delegated("_tools", Tools.staging_bytes)
    timeline = Delegated("_tools", Tools.timeline)
    reconfigure = Delegated("_tools", Tools.reconfigure)
    prefetch = Delegated("_prefetcher", Prefetcher.prefetch, "its setting is the constructor's")
    graph_stats = Delegated("_graphing", GraphRunner.stats)

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        distributed_mesh=None,
        **settings,  # offload, chunk_bytes, ...: Settings.check's, with its defaults
    ):
        algorithms = self.algorithms.values()
        batches = any(not a.elementwise for a in algorithms)
        settings = Settings.check(
            **settings, backends=common_backends(algorithms), batches_matrices=batches
        )
        mesh = resolve_mesh(distributed_mesh)
        capture_rules.check_settings(settings, mesh.group, algorithms)
        # As torch's optimizers: the hyper-parameters are checked before params is read.
        self._read_hyper(dict(defaults, params=[]), None)
        self._setup(settings, mesh)
        self._constructed = False
        super().__init__(params, defaults)
        _groups_added(self)
        self._constructed = True
        first_compile.prestart(self)  # the first step's compile workers, starting meanwhile

    def _setup(self, settings: Settings, mesh: Mesh) -> None:
        """The engine's parts, nothing built yet: what they share, then the collaborators
        that do the work, each handed the shared parts it reads."""
        self._mesh = mesh
        self._group_meshes: dict[int, Mesh] = {}
        self._agreements = StepAgreements()  # filled in __init__ and add_param_group
        # The settings as they are now (read as opt.chunk_bytes, ...); the plans by what they
        # depend on (cleared when state is created or loaded, or the budgets change); where
        # state lives; each parameter's count of the steps that updated it; the 8-bit rows
        # the last state_dict() handed out (sharded_scales.py).
        self._settings = live = LiveSettings(settings, common_backends(self.algorithms.values()))
        self._plans = plans = PlanCache()
        self._store = store = StateStore()
        self._counts = counts = StepCounts()
        self._handed_scales = handed = HandedScales()
        self._streams = streams = Streams(store, live)  # the scheduler, made for the step's device
        policy = self.state_policy(settings.state_dtype)
        self._states = states = StateBuilder(
            self.algorithms, policy, live, store, counts, plans, streams, handed
        )
        self._planner = StepPlanner(live, states, plans)
        blocker = capture_rules.mesh_blocker(mesh.group)  # "auto" stays eager on a gloo mesh
        self._graphing = graphing = GraphRunner(live, streams, self.algorithms, blocker)
        self._prefetcher = Prefetcher(live, streams, plans, store, handed, graphing)
        self._checkpoints = Checkpoints(live, streams, states, counts, handed, plans)
        self._tools = Tools(store, streams, live, plans)
        # The step's tables (Triton path): its scalars, its gradients' addresses.
        self._scalars: ScalarTable | None = None
        self._grad_table: GradTable | None = None
        self._cpu_notice_given = False

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return self._checkpoints.save(self, super().state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the existing state tensors (host slabs stay where they are), converting
        dtype and device as needed. Everything is checked before anything is written."""
        self._checkpoints.load(self, state_dict)

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy``, ``pickle`` and ``torch.save(opt)``: settings, groups and
        state values; the copy builds its own host slabs and streams (``__setstate__``)."""
        return self._checkpoints.for_copy(self, super().__getstate__)

    def __setstate__(self, state: dict) -> None:
        restore_copy(self, state, super().__setstate__)

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
            self._states.check_quantizable(group["params"], index)
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
        return group_pairs(self.param_groups)

    def _placement(self, gi: int, param: Tensor, hyper: Hyper) -> Placement:
        where = f"param group {gi} (parameter of shape {tuple(param.shape)})"
        return self.algorithms[hyper.algorithm].placement(param, self._mesh_of(gi), hyper, where)

    def _plan(self, work: StepWork, hypers: Sequence[Hyper], classes=None):
        """This step's plan, transfers, layouts and side chunks (``StepPlanner.plan``)."""
        return self._planner.plan(
            self._state, work, hypers, classes, self._placement, self._mesh_of
        )

    def _hypers(self) -> list[Hyper]:
        return [self._read_hyper(g, i) for i, g in enumerate(self.param_groups)]

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
        self._states.for_step(self._state, self.param_groups, hypers, work, device, self._placement)
        counted = [self.algorithms[h.algorithm].counts_steps for h in hypers]
        slots, counts, classes = self._counts.for_step(which(work), work.params, counted)
        plan, transfers, layouts, side = self._plan(work, hypers, classes)
        sched = self._streams.for_step(device)
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
            self._state, self._store.formats, work, hypers, steps, self.backend, layouts, counts
        )

        def update(i: int, views: Sequence[Tensor] | None) -> None:
            memo = None if views is None else sched.chunk_memo(i)
            row, grads = rows and rows[i], grad_rows and grad_rows[i]
            run_chunk(ctx, layouts[i], views, progress[i], row, grads, memo)

        try:
            first_compile.before(self, ctx, layouts, rows, device)  # new kernels: in parallel
            # Maybe a graph; "auto" runs a step with a closure eagerly (the closure's work and
            # the step's are the user's to order, not a graph's).
            tables = (self._scalars, self._grad_table)
            closed = closure is not None
            self._graphing.run(
                work, layouts, hypers, transfers, update, side, closed, self._state, tables
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
    opt._states.ensure(opt.state, opt.param_groups, opt._hypers(), opt._placement)
    opt._prefetcher.hook(p for _, p in opt._params())
