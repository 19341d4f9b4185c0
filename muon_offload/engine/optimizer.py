"""``ChunkedOptimizer``: the engine under ``Muon`` and ``AdamW``.

A step runs in four stages:
1. read and check every group and gradient (nothing is touched before this passes);
2. create missing state (``state.py``): in pinned host slabs (offloaded) or beside the
   parameters (resident), in the planner's order so each chunk's state is mostly one range;
3. plan (``planner.py``): units and chunks of at most ``chunk_bytes`` of state (cached while
   the set of parameters with gradients stays the same);
4. run the chunks through the scheduler (``scheduler.py``): load, let each unit's algorithm
   update it, store back. An exception becomes ``StepInterrupted`` (``interrupt.py``).

Subclasses name their algorithms (``algorithms``: group ``algorithm`` -> ``Algorithm``) and
say how a group reads (``_read_hyper``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..distributed import (
    DTensor,
    Mesh,
    Placement,
    check_ranks_agree,
    local,
    placement_of,
    resolve_mesh,
    run_tasks,
)
from ..hyper import Hyper, check_grad
from . import checkpoint, dispatch
from .algorithm import Algorithm, UnitJob
from .interrupt import interrupted
from .planner import MuonUnit, ParamInfo, Plan, plan_step, unit_params
from .scheduler import StreamScheduler, Transfer, plan_transfer
from .state import NewState, StateStore

log = logging.getLogger(__name__)

LOCAL_PLACEMENT = Placement("local")  # element-wise parameters: no communication

# The fastest offloaded step for fp32 state in the chunk-size sweep on the H200, within 1% of
# the best for bf16 (docs/benchmarks.md, "Choosing chunk_bytes").
DEFAULT_CHUNK_BYTES = 128 << 20
# Resident state crosses no bus: its chunks only set how many matrices share a batch and a
# launch. At 512 MiB the resident step is no longer host-bound (docs/benchmarks.md); the cost
# is the orthogonalizer's workspace, which scales with the batch.
DEFAULT_RESIDENT_CHUNK_BYTES = 512 << 20


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class ChunkedOptimizer(Optimizer):
    """Base class of the chunked, optionally offloaded, optimizers."""

    # The group's ``algorithm`` -> its per-unit update (and state keys).
    algorithms: dict[str, Algorithm] = {}

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        offload: bool,
        chunk_bytes: int | None,
        resident_bytes: int | None,
        resident_chunk_bytes: int | None = None,
        state_dtype: torch.dtype | None,
        backend: str,
        distributed_mesh=None,
    ):
        self._mesh = resolve_mesh(distributed_mesh)
        self._group_meshes: dict[int, Mesh] = {}
        if chunk_bytes is None:
            chunk_bytes = DEFAULT_CHUNK_BYTES
        check_positive_int("chunk_bytes", chunk_bytes)
        if resident_chunk_bytes is None:
            resident_chunk_bytes = max(chunk_bytes, DEFAULT_RESIDENT_CHUNK_BYTES)
        check_positive_int("resident_chunk_bytes", resident_chunk_bytes)
        if resident_bytes is not None and (
            isinstance(resident_bytes, bool)
            or not isinstance(resident_bytes, int)
            or resident_bytes < 0
        ):
            raise ValueError(f"resident_bytes must be an int >= 0 or None, got {resident_bytes!r}")
        if state_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"state_dtype must be None, torch.float32 or torch.bfloat16, got {state_dtype!r}"
            )
        if backend not in dispatch.BACKENDS:
            raise ValueError(f"backend must be one of {dispatch.BACKENDS}, got {backend!r}")
        self.offload = bool(offload)
        self.chunk_bytes = chunk_bytes
        self.resident_chunk_bytes = resident_chunk_bytes
        # Without offload everything is resident; with it, resident_bytes of state stay.
        self.resident_bytes = resident_bytes if self.offload else None
        self.state_dtype = state_dtype
        self.backend = backend
        self._plans: dict[tuple, tuple[Plan, list[Transfer | None]]] = {}
        self._store = StateStore()
        self._scheduler: StreamScheduler | None = None
        self._oversized_logged: set[Tensor] = set()
        self._cpu_notice_given = False
        self._timeline_marks: list | None = None  # set inside ``timeline()``
        self._constructed = False
        super().__init__(params, defaults)
        check_ranks_agree(self.param_groups, self._mesh_of)
        self._constructed = True

    # ----------------------------------------------------------------- groups

    def _read_hyper(self, group: dict, index: int) -> Hyper:
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        # A group's own mesh (MoE experts sharded over another mesh than attention) is kept
        # beside the group, not in it: a group dict goes into state_dict(), a mesh must not.
        param_group = dict(param_group)
        group_mesh = param_group.pop("distributed_mesh", None)
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            if group_mesh is not None:
                self._group_meshes[index] = resolve_mesh(group_mesh)
            hyper = self._read_hyper(self.param_groups[index], index)
            for p in self.param_groups[index]["params"]:
                self._placement(index, p, hyper)
            if self._constructed:
                check_ranks_agree(self.param_groups, self._mesh_of)
        except Exception:
            self.param_groups.pop()
            self._group_meshes.pop(index, None)
            raise

    def _mesh_of(self, group_index: int) -> Mesh:
        return self._group_meshes.get(group_index, self._mesh)

    def _params(self) -> list[tuple[int, Tensor]]:
        return [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]

    def _placement(self, gi: int, param: Tensor, hyper: Hyper) -> Placement:
        if self.algorithms[hyper.algorithm].elementwise:
            return LOCAL_PLACEMENT
        where = f"param group {gi} (parameter of shape {tuple(param.shape)})"
        return placement_of(param, self._mesh_of(gi), hyper.flatten, where)

    # ------------------------------------------------------------------ state

    @property
    def _host(self):  # the host slabs, for tests that check where state lives
        return self._store.host

    @property
    def _streamed(self) -> set[Tensor]:
        return self._store.streamed

    def _state_keys(self, algorithm: str) -> tuple[str, ...]:
        return self.algorithms[algorithm].state_keys

    def _state_dtype(self, param: Tensor) -> torch.dtype:
        return self.state_dtype or param.dtype

    def _plan_bytes(self, param: Tensor, hyper: Hyper) -> int:
        """State bytes for budgeting and for the resident budget, equal on every rank: a
        sharded (DTensor) parameter counts its global state over the mesh size, never its
        local shard, which differs across ranks when shards are uneven."""
        per_elem = len(self._state_keys(hyper.algorithm)) * self._state_dtype(param).itemsize
        if not isinstance(param, DTensor):
            return per_elem * local(param).numel()
        return -(-per_elem * param.numel() // param.device_mesh.size())

    def _param_info(self, index: int, group: int, p: Tensor, hyper: Hyper, resident: bool):
        return ParamInfo(
            index=index,
            group=group,
            algorithm=hyper.algorithm,
            numel=local(p).numel(),
            plan_bytes=self._plan_bytes(p, hyper),
            batch_key=(
                tuple(p.shape),
                p.dtype,
                self._state_dtype(p),
                self._placement(group, p, hyper),
            ),
            resident=resident,
        )

    def _ensure_state(self, hypers: Sequence[Hyper]) -> None:
        """Create state for every parameter that has none, in plan order."""
        missing = [(gi, p) for gi, p in self._params() if not self.state.get(p)]
        if not missing:
            return
        store, infos = self._store, []
        for i, (gi, p) in enumerate(missing):
            nbytes = self._plan_bytes(p, hypers[gi])
            resident = not self.offload or (
                self.resident_bytes is not None
                and store.resident_used + nbytes <= self.resident_bytes
            )
            if resident and self.offload:
                store.resident_used += nbytes
            infos.append(self._param_info(i, gi, p, hypers[gi], resident))
        plan = plan_step(infos, self.chunk_bytes, self.resident_chunk_bytes)
        order = [i for unit in plan.units() for i in unit_params(unit)]
        # A split element-wise param appears once per piece; an empty one in no unit at all.
        store.create(
            self.state,
            [
                NewState(
                    missing[i][1],
                    self._state_keys(infos[i].algorithm),
                    self._state_dtype(missing[i][1]),
                    streamed=not infos[i].resident,
                )
                for i in dict.fromkeys([*order, *range(len(missing))])
            ],
        )
        self._plans.clear()

    def _synchronize(self) -> None:
        """Wait for in-flight write-backs, so host state can be read by the CPU."""
        if self._streamed and self._scheduler is not None and self._scheduler.cuda:
            torch.cuda.current_stream(self._scheduler.device).synchronize()

    def state_dict(self) -> dict:
        self._synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the existing state tensors (host slabs stay where they are), converting
        dtype and device as needed. Everything is checked before anything is written."""
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        new_groups = checkpoint.check_groups(self.param_groups, saved_groups)
        hypers = [self._read_hyper(g, i) for i, g in enumerate(new_groups)]
        keys = {name: a.state_keys for name, a in self.algorithms.items()}
        loaded = checkpoint.check_state(
            self.param_groups, saved_groups, state_dict["state"], hypers, keys
        )
        self._synchronize()
        for group, new in zip(self.param_groups, new_groups, strict=True):
            group.clear()
            group.update(new)
        self._ensure_state(hypers)
        checkpoint.copy_state(self.state, self._params(), hypers, keys, loaded)
        self._plans.clear()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # --------------------------------------------------------------- planning

    def _plan(self, work: list[tuple[int, Tensor]], hypers: Sequence[Hyper]):
        key = (
            tuple(id(p) for _, p in work),
            tuple((h.algorithm, h.flatten, h.split_sizes) for h in hypers),
            self.chunk_bytes,
            self.resident_chunk_bytes,
        )
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        infos = [
            self._param_info(i, gi, p, hypers[gi], p not in self._streamed)
            for i, (gi, p) in enumerate(work)
        ]
        plan = plan_step(infos, self.chunk_bytes, self.resident_chunk_bytes)
        for i in plan.oversized:
            gi, p = work[i]
            if p not in self._oversized_logged:
                self._oversized_logged.add(p)
                log.warning(
                    "param group %d: a parameter of shape %s has more state than "
                    "chunk_bytes=%d; it is streamed as a chunk of its own",
                    gi,
                    tuple(p.shape),
                    self.chunk_bytes,
                )
        transfers = [
            None if chunk.resident else plan_transfer(self._chunk_state(chunk, work))
            for chunk in plan.chunks
        ]
        self._plans[key] = (plan, transfers)
        return plan, transfers

    def _unit_items(self, unit, work) -> list[tuple[Tensor, slice | None]]:
        """(parameter, flat element range or None for the whole) of each item of a unit."""
        if isinstance(unit, MuonUnit):
            return [(work[i][1], None) for i in unit.params]
        return [(work[s.param][1], slice(s.start, s.stop)) for s in unit.segments]

    def _chunk_state(self, chunk, work) -> list[Tensor]:
        """The state tensors a chunk updates: unit by unit, item by item, key by key (the
        order state is allocated in, so adjacent tensors merge into one copy)."""
        out = []
        for unit in chunk.units:
            keys = self._state_keys(unit.algorithm)
            for p, span in self._unit_items(unit, work):
                for key in keys:
                    t = local(self.state[p][key])
                    out.append(t if span is None else t.view(-1)[span])
        return out

    # ------------------------------------------------------------------- step

    def _check_step(self) -> tuple[list[Hyper], list[tuple[int, Tensor]], torch.device | None]:
        hypers = [self._read_hyper(g, i) for i, g in enumerate(self.param_groups)]
        work = []
        devices = set()
        for gi, p in self._params():
            if p.grad is None:
                continue
            check_grad(p, gi)
            if not local(p).is_contiguous():
                raise ValueError(
                    f"param group {gi} (parameter of shape {tuple(p.shape)}): parameters must "
                    "be contiguous to be updated in place"
                )
            devices.add(local(p).device)
            work.append((gi, p))
        if len(devices) > 1:
            raise ValueError(
                f"all parameters must be on one device, got {sorted(map(str, devices))}"
            )
        device = devices.pop() if devices else None
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
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hypers, work, device = self._check_step()
        for group in self.param_groups:
            group["step"] += 1
        if not work:
            return loss
        self._ensure_state(hypers)
        plan, transfers = self._plan(work, hypers)
        if self._scheduler is None or self._scheduler.device != device:
            self._scheduler = StreamScheduler(device)
        self._scheduler.timeline = self._timeline_marks
        steps = [g["step"] for g in self.param_groups]
        finished: list[list[int]] = [[] for _ in plan.chunks]  # unit indices done, per chunk

        def update(i: int, views: list[Tensor] | None) -> None:
            self._update_chunk(plan.chunks[i], work, hypers, steps, views, finished[i])

        try:
            self._scheduler.run(transfers, update)
        except Exception as err:
            raise interrupted(plan, work, finished, err, self.param_groups) from err
        return loss

    def _update_chunk(self, chunk, work, hypers, steps, views, done: list[int]) -> None:
        """Run every unit of a chunk on its state (``views``: the staging copies of a
        streamed chunk; None: resident state, updated in place). Units run as dion-style
        tasks, so one unit's collective is in flight while the next computes; the planner
        puts matrix units first, in the same order on every rank."""
        tensors = views if views is not None else self._chunk_state(chunk, work)
        spans = self._unit_spans(chunk)

        def task(k: int):
            unit = chunk.units[k]
            items = self._unit_items(unit, work)
            algorithm = self.algorithms[unit.algorithm]
            nkeys = len(algorithm.state_keys)
            state = tensors[slice(*spans[k])]
            if algorithm.elementwise:
                params = [local(p).view(-1)[span] for p, span in items]
                grads = [local(p.grad).reshape(-1)[span] for p, span in items]
            else:
                params = [p for p, _ in items]
                grads = [local(p.grad) for p, _ in items]
            job = UnitJob(
                group=unit.group,
                hyper=hypers[unit.group],
                step=steps[unit.group],
                backend=self.backend,
                mesh=self._mesh_of(unit.group),
                params=params,
                grads=grads,
                state=[state[j::nkeys] for j in range(nkeys)],
            )
            running = algorithm.update(job)
            if running is not None:
                yield from running
            done.append(k)

        try:
            run_tasks(task(k) for k in range(len(chunk.units)))
        except BaseException:
            if views is not None:
                # The chunk will not be stored: keep what its finished units computed, and
                # the host's (untouched) state for the rest.
                host = self._chunk_state(chunk, work)
                for k in done:
                    for j in range(*spans[k]):
                        host[j].copy_(views[j])
            raise

    def _unit_spans(self, chunk) -> list[tuple[int, int]]:
        """Each unit's range in the chunk's state list (``_chunk_state`` order)."""
        spans, start = [], 0
        for unit in chunk.units:
            count = len(unit_params(unit)) * len(self._state_keys(unit.algorithm))
            spans.append((start, start + count))
            start += count
        return spans

    # ------------------------------------------------ what tools read and set

    @property
    def host_state_bytes(self) -> int:
        """Bytes of host memory (pinned where a GPU exists) held for streamed state."""
        return self._host.nbytes if self._host is not None else 0

    def host_buffers(self) -> list[Tensor]:
        """The host buffers (uint8) that hold streamed state, for reading it all at once."""
        return list(self._host.slabs) if self._host is not None else []

    @property
    def staging_bytes(self) -> int:
        """Bytes of the device staging ring (0 before the first offloaded step)."""
        return self._scheduler.staging_bytes if self._scheduler is not None else 0

    def reconfigure(
        self, chunk_bytes: int | None = None, resident_chunk_bytes: int | None = None
    ) -> None:
        """Other chunk budgets for the same state: the next step plans afresh and sizes a new
        staging ring. State stays where it is."""
        for name, value in (
            ("chunk_bytes", chunk_bytes),
            ("resident_chunk_bytes", resident_chunk_bytes),
        ):
            if value is not None:
                check_positive_int(name, value)
                setattr(self, name, value)
        self._synchronize()
        self._scheduler = None
        self._plans.clear()

    @contextlib.contextmanager
    def timeline(self) -> Iterator[list[dict]]:
        """Record the chunk stages of the steps run inside the block::

            with opt.timeline() as rows:
                opt.step()

        ``rows`` is filled on exit: ``{"chunk", "stage", "start_ms", "end_ms"}`` per chunk and
        stage (``load``, ``update``, ``store``), ms from the first start: CUDA events on each
        stream on a GPU; on the CPU the stages run one after another."""
        rows: list[dict] = []
        marks: list = []
        self._timeline_marks = marks  # step() hands it to the scheduler
        try:
            yield rows
        finally:
            self._timeline_marks = None
            sched = self._scheduler
            if sched is not None:
                sched.timeline = None
                if sched.cuda:
                    torch.cuda.synchronize(sched.device)
                rows.extend(sched.timeline_rows(marks))
