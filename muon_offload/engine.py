"""The optimizer engine shared by ``Muon`` and ``AdamW``.

A step runs in four stages:
1. read and check every group and gradient (nothing is touched before this passes);
2. create missing state: in pinned host slabs (offloaded) or on the parameters' device
   (resident), in the planner's order so each chunk's state is mostly one contiguous range;
3. plan: units and chunks of at most ``chunk_bytes`` of state (cached while the set of
   parameters with gradients stays the same);
4. run the chunks through the scheduler: load, update with the fused kernels, store back.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from . import ops
from .collectives import (
    DTensor,
    Mesh,
    Placement,
    dtensor_around,
    local,
    orthogonalize_replicated,
    orthogonalize_sharded,
    placement_of,
    resolve_mesh,
    run_tasks,
)
from .groups import Hyper, adjusted_lr, check_grad, split_lr_scales
from .host_state import HostSlabs
from .interrupt import interrupted
from .planner import ElementwiseUnit, MuonUnit, ParamInfo, Plan, plan_step, unit_params
from .scheduler import StreamScheduler, Transfer, plan_transfer

log = logging.getLogger(__name__)

LOCAL_PLACEMENT = Placement("local")  # element-wise parameters: no communication

# Chosen by a sweep on the H200 (docs/benchmarks.md, qwen3-30b-a3b-ep8-rank): 128 MiB gave the
# fastest offloaded step for fp32 state (0.324 s against 0.326 at 64 MiB, 0.336 at 256 MiB,
# 0.469 at 32 MiB where Muon batches get too small) and within 1% of the best for bf16 state,
# with 0.66 GiB of GPU memory for the staging ring and temporaries.
DEFAULT_CHUNK_BYTES = 128 << 20
# Resident state crosses no bus: its chunks only decide how many same-shape matrices are
# orthogonalized together and how many segments share a launch. At 128 MiB the resident
# bench step issued ~2,300 launches and the host took as long as the card (0.155 vs 0.15 s),
# so host stalls showed as slow steps; at 512 MiB the host needs 0.06 s and the step 0.149 s
# (bench/resident_vs_dion.py, H200, 2026-11-30; 2 GiB was no faster). The cost is workspace:
# the orthogonalizer's buffers scale with the batch (docs/usage.md).
DEFAULT_RESIDENT_CHUNK_BYTES = 512 << 20


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class ChunkedOptimizer(Optimizer):
    """Base class: subclasses say how a group reads (``_read_hyper``) and name the state."""

    # State tensors per algorithm, by the names they carry in ``state_dict()``.
    state_keys: dict[str, tuple[str, ...]] = {}

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
        _check_positive_int("chunk_bytes", chunk_bytes)
        if resident_chunk_bytes is None:
            resident_chunk_bytes = max(chunk_bytes, DEFAULT_RESIDENT_CHUNK_BYTES)
        _check_positive_int("resident_chunk_bytes", resident_chunk_bytes)
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
        if backend not in ops.BACKENDS:
            raise ValueError(f"backend must be one of {ops.BACKENDS}, got {backend!r}")
        self.offload = bool(offload)
        self.chunk_bytes = chunk_bytes
        self.resident_chunk_bytes = resident_chunk_bytes
        # Without offload everything is resident; with it, resident_bytes of state stay.
        self.resident_bytes = resident_bytes if self.offload else None
        self.state_dtype = state_dtype
        self.backend = backend
        self._plans: dict[tuple, tuple[Plan, list[Transfer | None]]] = {}
        self._host: HostSlabs | None = None
        self._scheduler: StreamScheduler | None = None
        self._resident_used = 0
        self._streamed: set[Tensor] = set()  # parameters whose state lives in host memory
        self._oversized_logged: set[Tensor] = set()
        self._cpu_notice_given = False
        self._timeline_marks: list | None = None  # set inside ``timeline()``
        self._constructed = False
        super().__init__(params, defaults)
        self._check_ranks_agree()
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
                if hyper.algorithm == "muon":
                    placement_of(
                        p,
                        self._mesh_of(index),
                        hyper.flatten,
                        f"param group {index} (parameter of shape {tuple(p.shape)})",
                    )
            if self._constructed:
                self._check_ranks_agree()
        except Exception:
            self.param_groups.pop()
            self._group_meshes.pop(index, None)
            raise

    def _mesh_of(self, group_index: int) -> Mesh:
        return self._group_meshes.get(group_index, self._mesh)

    def _check_ranks_agree(self) -> None:
        """Every rank of a mesh must hold the same parameters (global shapes and dtypes) in
        the same groups, or the collectives would pair the wrong tensors. Checked once, at
        construction and when a group is added, before any step's collective."""
        meshes = {}
        for gi in range(len(self.param_groups)):
            mesh = self._mesh_of(gi)
            if mesh.group is not None:
                meshes.setdefault(id(mesh.group), (mesh, []))[1].append(gi)
        for mesh, group_indices in meshes.values():
            mine = [
                (gi, self.param_groups[gi].get("algorithm"), tuple(p.shape), str(p.dtype))
                for gi in group_indices
                for p in self.param_groups[gi]["params"]
            ]
            everyone = [None] * mesh.size
            dist.all_gather_object(everyone, mine, group=mesh.group)
            for rank, theirs in enumerate(everyone):
                if theirs != mine:
                    diff = next(
                        (a, b)
                        for a, b in zip(mine + [None], theirs + [None], strict=False)
                        if a != b
                    )
                    raise ValueError(
                        f"parameters differ across ranks: this rank (rank {mesh.rank}) has "
                        f"{diff[0]}, rank {rank} has {diff[1]} (group, algorithm, shape, dtype)"
                    )

    def _params(self) -> list[tuple[int, Tensor]]:
        return [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]

    # ------------------------------------------------------------------ state

    def _state_dtype(self, param: Tensor) -> torch.dtype:
        return self.state_dtype or param.dtype

    def _state_nbytes(self, algorithm: str, param: Tensor) -> int:
        """Bytes of this rank's state for ``param``."""
        itemsize = self._state_dtype(param).itemsize
        return len(self.state_keys[algorithm]) * local(param).numel() * itemsize

    def _plan_bytes(self, gi: int, param: Tensor, hyper: Hyper) -> int:
        """State bytes for budgeting and for the resident budget, equal on every rank: a
        sharded (DTensor) parameter counts its global state over the mesh size, never its
        local shard, which differs across ranks when shards are uneven."""
        if not isinstance(param, DTensor):
            return self._state_nbytes(hyper.algorithm, param)
        itemsize = self._state_dtype(param).itemsize
        total = len(self.state_keys[hyper.algorithm]) * param.numel() * itemsize
        return -(-total // param.device_mesh.size())

    def _placement(self, gi: int, param: Tensor, hyper: Hyper):
        if hyper.algorithm != "muon":
            return LOCAL_PLACEMENT
        where = f"param group {gi} (parameter of shape {tuple(param.shape)})"
        return placement_of(param, self._mesh_of(gi), hyper.flatten, where)

    def _ensure_state(self, hypers: Sequence[Hyper]) -> None:
        """Create state for every parameter that has none, in plan order."""
        missing = [(gi, p) for gi, p in self._params() if not self.state.get(p)]
        if not missing:
            return
        infos, params = [], []
        for gi, p in missing:
            nbytes = self._plan_bytes(gi, p, hypers[gi])
            resident = not self.offload or (
                self.resident_bytes is not None
                and self._resident_used + nbytes <= self.resident_bytes
            )
            if resident and self.offload:
                self._resident_used += nbytes
            infos.append(self._param_info(len(params), gi, p, hypers[gi], resident))
            params.append(p)
        order = [
            i
            for unit in plan_step(infos, self.chunk_bytes, self.resident_chunk_bytes).units()
            for i in unit_params(unit)
        ]
        streamed = []
        # A split element-wise param appears once per piece; an empty one in no unit at all.
        for i in dict.fromkeys([*order, *range(len(params))]):
            p, info = params[i], infos[i]
            keys = self.state_keys[info.algorithm]
            if info.resident:
                dtype = self._state_dtype(p)
                self.state[p].update(
                    {k: _like_param(torch.zeros_like(local(p), dtype=dtype), p) for k in keys}
                )
            else:
                streamed.append((p, keys))
                self._streamed.add(p)
        if streamed:
            if self._host is None:
                self._host = HostSlabs(pin=local(streamed[0][0]).is_cuda)
            specs = [(local(p).shape, self._state_dtype(p)) for p, keys in streamed for _ in keys]
            tensors = iter(self._host.allocate(specs))
            for p, keys in streamed:
                self.state[p].update({k: _like_param(next(tensors), p) for k in keys})
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
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for i, (ours, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if len(ours["params"]) != len(saved["params"]):
                raise ValueError(
                    f"param group {i}: loaded state dict has "
                    f"{len(saved['params'])} parameters, the optimizer "
                    f"{len(ours['params'])}"
                )
        new_groups = [
            {**ours, **saved, "params": ours["params"]}
            for ours, saved in zip(self.param_groups, saved_groups, strict=True)
        ]
        hypers = [self._read_hyper(g, i) for i, g in enumerate(new_groups)]
        owner = {
            saved_id: (gi, p)
            for gi, (ours, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True))
            for saved_id, p in zip(saved["params"], ours["params"], strict=True)
        }
        loaded: dict[Tensor, dict] = {}
        for saved_id, values in state_dict["state"].items():
            gi, p = owner[saved_id]
            for key in self.state_keys[hypers[gi].algorithm]:
                value = values.get(key)
                if isinstance(value, Tensor):
                    value = local(value)
                if not isinstance(value, Tensor) or value.numel() != local(p).numel():
                    raise ValueError(
                        f"param group {gi} (parameter of shape {tuple(p.shape)}): loaded state "
                        f"{key!r} is {'missing' if value is None else tuple(value.shape)}"
                    )
            loaded[p] = values

        self._synchronize()
        for group, new in zip(self.param_groups, new_groups, strict=True):
            group.clear()
            group.update(new)
        self._ensure_state(hypers)
        for gi, p in self._params():
            for key in self.state_keys[hypers[gi].algorithm]:
                target = local(self.state[p][key])
                if p in loaded:
                    target.copy_(local(loaded[p][key]).reshape(target.shape))
                else:
                    target.zero_()
        self._plans.clear()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

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
        if chunk_bytes is not None:
            _check_positive_int("chunk_bytes", chunk_bytes)
            self.chunk_bytes = chunk_bytes
        if resident_chunk_bytes is not None:
            _check_positive_int("resident_chunk_bytes", resident_chunk_bytes)
            self.resident_chunk_bytes = resident_chunk_bytes
        self._synchronize()
        self._scheduler = None
        self._plans.clear()

    @contextlib.contextmanager
    def timeline(self) -> Iterator[list[dict]]:
        """Record the chunk stages of the steps run inside the block::

            with opt.timeline() as rows:
                opt.step()

        ``rows`` is filled on exit: ``{"chunk", "stage", "start_ms", "end_ms"}`` per chunk and
        stage (``load``, ``update``, ``store``), ms from the first start. On a GPU they are
        CUDA events on each stream; on the CPU the stages run one after another."""
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

    def _is_resident(self, param: Tensor) -> bool:
        return param not in self._streamed

    # --------------------------------------------------------------- planning

    def _param_info(self, index: int, group: int, p: Tensor, hyper: Hyper, resident: bool):
        placement = self._placement(group, p, hyper)
        return ParamInfo(
            index=index,
            group=group,
            algorithm=hyper.algorithm,
            numel=local(p).numel(),
            plan_bytes=self._plan_bytes(group, p, hyper),
            batch_key=(tuple(p.shape), p.dtype, self._state_dtype(p), placement),
            resident=resident,
        )

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
            self._param_info(i, gi, p, hypers[gi], self._is_resident(p))
            for i, (gi, p) in enumerate(work)
        ]
        plan = plan_step(infos, self.chunk_bytes, self.resident_chunk_bytes)
        for i in plan.oversized:
            gi, p = work[i]
            if p in self._oversized_logged:
                continue
            self._oversized_logged.add(p)
            log.warning(
                "param group %d: a parameter of shape %s has more state than chunk_bytes=%d; "
                "it is streamed as a chunk of its own",
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

    def _chunk_state(self, chunk, work) -> list[Tensor]:
        """The state tensors a chunk updates, in the order ``_update_chunk`` consumes them."""
        out = []
        for unit in chunk.units:
            if isinstance(unit, MuonUnit):
                key = self.state_keys["muon"][0]
                out.extend(local(self.state[work[i][1]][key]) for i in unit.params)
                continue
            for seg in unit.segments:
                state = self.state[work[seg.param][1]]
                for key in self.state_keys[unit.algorithm]:
                    out.append(local(state[key]).view(-1)[seg.start : seg.stop])
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
            chunk = plan.chunks[i]
            tensors = views if views is not None else self._chunk_state(chunk, work)
            state = iter(tensors)
            done = finished[i]
            # Muon units run as dion-style tasks, so one unit's collective is in flight while
            # the next unit computes; they are planned first, so they consume state first.
            muon = [u for u in chunk.units if isinstance(u, MuonUnit)]

            def tracked(k: int, unit: MuonUnit):
                yield from self._muon_task(unit, work, hypers[unit.group], state)
                done.append(k)

            try:
                run_tasks(tracked(k, u) for k, u in enumerate(muon))
                for k in range(len(muon), len(chunk.units)):
                    unit = chunk.units[k]
                    self._update_elementwise(
                        unit, work, hypers[unit.group], steps[unit.group], state
                    )
                    done.append(k)
            except BaseException:
                if views is not None:
                    # The chunk will not be stored: keep what its finished units computed,
                    # and the host's (untouched) state for the rest.
                    host = self._chunk_state(chunk, work)
                    spans = self._unit_spans(chunk)
                    for k in done:
                        for j in range(*spans[k]):
                            host[j].copy_(views[j])
                raise

        try:
            self._scheduler.run(transfers, update)
        except Exception as err:
            raise interrupted(plan, work, finished, err, self.param_groups) from err
        return loss

    def _unit_spans(self, chunk) -> list[tuple[int, int]]:
        """Each unit's range in the chunk's state list (``_chunk_state`` order)."""
        spans, start = [], 0
        for unit in chunk.units:
            if isinstance(unit, MuonUnit):
                count = len(unit.params)
            else:
                count = len(unit.segments) * len(self.state_keys[unit.algorithm])
            spans.append((start, start + count))
            start += count
        return spans

    def _muon_task(self, unit: MuonUnit, work, h: Hyper, state):
        """One Muon unit: prep, orthogonalize (with collectives when the mesh needs them),
        apply. A generator that yields while a collective is in flight."""
        params = [work[i][1] for i in unit.params]
        momentums = [next(state) for _ in params]  # before the first yield: keeps the order
        xs, gs, ms = [], [], []
        for p, m in zip(params, momentums, strict=True):
            xs.extend(_matrices(local(p), h.flatten))
            gs.extend(_matrices(local(p.grad), h.flatten))
            ms.extend(_matrices(m, h.flatten))
        if not ms:  # a stack sharded along its batch dim, with no matrices on this rank
            return
        if ms[0].numel():
            update, sumsq = ops.muon_prep(self.backend, ms, gs, mu=h.mu, nesterov=h.nesterov)
        else:  # an empty shard still takes part in every collective
            update = torch.empty((len(ms), *ms[0].shape), dtype=torch.bfloat16, device=ms[0].device)
            sumsq = torch.zeros(len(ms), dtype=torch.float32, device=ms[0].device)
        shape = params[0].shape  # global shape: the lr adjustment is the whole matrix's
        scales = h.split_sizes and split_lr_scales(h.split_sizes, shape, h.adjust_lr)

        def orthogonalize(u: Tensor, s: Tensor | None) -> Tensor:
            return ops.orthogonalize_batch(
                u,
                s,
                method=self._orthogonalizer(),
                eps=h.eps,
                split_sizes=h.split_sizes,
                split_scales=scales,
            )

        placement = self._placement(unit.group, params[0], h)
        mesh = self._mesh_of(unit.group)
        if placement.kind == "sharded":
            ortho = yield from orthogonalize_sharded(update, placement, mesh, orthogonalize)
        elif placement.kind == "replicated":
            ortho = yield from orthogonalize_replicated(update, sumsq, mesh, orthogonalize)
        else:
            ortho = orthogonalize(update, sumsq)
        if xs[0].numel():
            ops.muon_apply_(
                self.backend,
                xs,
                ortho,
                lr=h.lr,
                weight_decay=h.weight_decay,
                adjusted_lr=adjusted_lr(h.lr, shape, h.adjust_lr, h.flatten),
            )

    def _update_elementwise(self, unit: ElementwiseUnit, work, h: Hyper, step: int, state):
        nkeys = len(self.state_keys[unit.algorithm])
        xs, gs, st = [], [], [[] for _ in range(nkeys)]
        for seg in unit.segments:
            p = work[seg.param][1]
            xs.append(local(p).view(-1)[seg.start : seg.stop])
            gs.append(local(p.grad).reshape(-1)[seg.start : seg.stop])
            for k in range(nkeys):
                st[k].append(next(state))
        if unit.algorithm == "adamw":
            ops.adamw_(
                self.backend,
                xs,
                gs,
                st[0],
                st[1],
                lr=h.lr,
                beta1=h.beta1,
                beta2=h.beta2,
                eps=h.eps,
                weight_decay=h.weight_decay,
                step=step,
            )
        else:
            ops.lion_(
                self.backend,
                xs,
                gs,
                st[0],
                lr=h.lr,
                beta1=h.beta1,
                beta2=h.beta2,
                weight_decay=h.weight_decay,
            )

    def _orthogonalizer(self):
        return "polar_express"


def _like_param(state: Tensor, param: Tensor) -> Tensor:
    """State of a DTensor parameter is a DTensor of the same layout around this rank's
    tensor (on the GPU or in the host slabs), so state_dict() and distributed checkpointing
    see it sharded like the parameter; the engine itself works on the local tensor.

    Built as FSDP2 builds its CPU-offloaded shards (``_from_local_no_grad``), not with
    ``DTensor.from_local``: that one moves a host tensor to the mesh's device type, which
    would put offloaded state back on the GPU."""
    if not isinstance(param, DTensor):
        return state
    return dtensor_around(state, param)


def _matrices(t: Tensor, flatten: bool) -> list[Tensor]:
    """The matrices a muon tensor is orthogonalized as (views, no copies for contiguous t;
    explicit sizes, so an empty shard still gives its count of empty matrices)."""
    if flatten:
        return [t.reshape(t.shape[0], math.prod(t.shape[1:]))]
    if t.ndim == 2:
        return [t]
    return list(t.reshape(math.prod(t.shape[:-2]), t.shape[-2], t.shape[-1]).unbind(0))
