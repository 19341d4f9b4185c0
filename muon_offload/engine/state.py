"""Creating optimizer state: where each parameter's state lives and the tensors that hold it.

State is created once per parameter, in the planner's order, so that the state of one chunk
is mostly one contiguous range of the host slabs and loads as one copy. Resident state sits
beside the parameter; streamed state is a view into pinned host slabs (``host_slabs.py``).
A DTensor parameter's state is a DTensor of the same layout around the local tensor, so
``state_dict()`` and distributed checkpointing see it sharded like the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..distributed import DTensor, dtensor_around, local
from .algorithm import Hyper
from .assigned_state import HeldState
from .group_checks import check_state_fits
from .host_slabs import HostSlabs
from .planner import ParamInfo, plan_step, unit_params
from .sharded_scales import check_placements
from .state_format import StateFormat, StatePolicy
from .step_work import StepWork, same_objects


@dataclass(frozen=True)
class NewState:
    """One parameter whose state is to be created."""

    param: Tensor
    fmt: StateFormat
    specs: list  # (name, shape, dtype) of each tensor, in allocation order
    streamed: bool


class StateIndex:
    """``state.get(p)`` for many parameters without hashing them: ``Tensor.__hash__`` is a
    Python function, one call a parameter a step (0.3 ms at 2474 tensors on a CPU). The
    dicts found are reused while cheap C-level passes prove that a lookup would find the same:
    the very same parameters (``is``) and state mapping, holding the very same keys and dicts
    in the same order (a dict stored, replaced or deleted changes them); what is in each dict
    is read by its users each step."""

    def __init__(self) -> None:
        self._seen: tuple | None = None  # (state, its keys, its dicts, params) when looked up
        self._dicts: tuple = ()

    def dicts(self, state: dict, params: tuple[Tensor, ...]) -> tuple[dict | None, ...]:
        seen = self._seen
        if (
            seen is None
            or seen[0] is not state
            or not (params is seen[3] or same_objects(params, seen[3]))
            or not same_objects(state, seen[1])
            or not same_objects(state.values(), seen[2])
        ):
            self._dicts = tuple(map(state.get, params))
            self._seen = (state, tuple(state), tuple(state.values()), params)
        return self._dicts


class StateStore:
    """Holds the host slabs and knows which parameters' state is streamed."""

    def __init__(self) -> None:
        self.index = StateIndex()  # the state dicts of the step's parameters
        self.host: HostSlabs | None = None
        self.streamed: set[Tensor] = set()  # parameters whose state lives in host memory
        self.resident_used = 0  # bytes of offload-mode state kept resident (resident_bytes)
        self.resident: dict[Tensor, int] = {}  # those bytes by parameter
        self.formats: dict[Tensor, object] = {}  # parameter -> its state's format
        # The devices of the parameters whose state was created (``StateBuilder.follow_device``).
        self.devices: set[torch.device] = set()
        # Parameters whose state is as created: no step or load since. A load may lay theirs
        # out afresh (``checkpoint.check_live_layout``), as if it did not exist yet.
        self.pristine: set[Tensor] = set()
        self.held = HeldState()  # the tensors made for each parameter's state

    def forget(self, params) -> None:
        """The state of ``params`` was dropped (``del opt.state[p]``, a new ``opt.state``): it
        is created afresh, resident or streamed as the budget says then, and its old host
        bytes are reused once nothing holds them (``HostSlabs.allocate``)."""
        for p in params:
            self.streamed.discard(p)
            self.pristine.discard(p)
            self.formats.pop(p, None)
            self.resident_used -= self.resident.pop(p, 0)
        self.held.forget(params)
        self.index = StateIndex()  # it holds the dropped dicts, so their tensors, alive

    def create(self, state: dict, new: list[NewState]) -> None:
        """Fill ``state[p]`` for each entry, in the given order."""
        streamed = []
        for entry in new:
            p = entry.param
            self.formats[p] = entry.fmt
            self.devices.add(local(p).device)
            self.pristine.add(p)
            if entry.streamed:
                streamed.append(entry)
                self.streamed.add(p)
                continue
            device = local(p).device
            made = {
                name: like_param(torch.zeros(shape, dtype=dtype, device=device), p, entry.fmt, name)
                for name, shape, dtype in entry.specs
            }
            state[p].update(made)
            self.held.keep(p, made)
        if not streamed:
            return
        if self.host is None:
            self.host = HostSlabs(pin=local(streamed[0].param).is_cuda)
        specs = [(shape, dtype) for e in streamed for _, shape, dtype in e.specs]
        # State dropped and made afresh goes back into the bytes it left (``HostSlabs``).
        owners = [e.param for e in streamed for _ in e.specs]
        tensors = iter(self.host.allocate(specs, owners))
        for e in streamed:
            made = {name: like_param(next(tensors), e.param, e.fmt, name) for name, _, _ in e.specs}
            state[e.param].update(made)
            self.held.keep(e.param, made)


def key_shapes(algorithm, p: Tensor) -> list[tuple[str, str, tuple[torch.Size, torch.Size]]]:
    """(key, kind, (global shape, local shape)) of each state key of ``p`` by its algorithm
    (``Algorithm.state_shapes``): the shapes its state tensors have (checkpoints check them)."""
    keys = algorithm.state_shapes(local(p).shape)
    whole = algorithm.state_shapes(p.shape) if isinstance(p, DTensor) else keys
    return [(k.key, k.kind, (w.shape, k.shape)) for k, w in zip(keys, whole, strict=True)]


def like_param(state: Tensor, param: Tensor, fmt: StateFormat, name: str) -> Tensor:
    """State of a DTensor parameter is a DTensor of the same layout around this rank's
    tensor (on the GPU or in the host slabs); the engine itself works on the local tensor.
    A format's side tensors (8-bit scales: one a block of this rank's shard) stay local
    tensors: ``state_dict()`` lays them out for distributed checkpoints (``sharded_scales.py``).

    Built as FSDP2 builds its CPU-offloaded shards (``_from_local_no_grad``), not with
    ``DTensor.from_local``: that one moves a host tensor to the mesh's device type, which
    would put offloaded state back on the GPU."""
    if not isinstance(param, DTensor) or fmt.is_side(name) or state.shape != local(param).shape:
        return state
    return dtensor_around(state, param)


def group_pairs(groups: Sequence[dict]) -> list[tuple[int, Tensor]]:
    """(group index, parameter) of every parameter of ``groups``, in order."""
    return [(gi, p) for gi, g in enumerate(groups) for p in g["params"]]


class StateBuilder:
    """Each parameter's state format and budget, and its state: created where it is missing
    (in plan order), moved with its parameters, checked against a step's shapes. It is handed
    the optimizer's live ``state`` and ``param_groups`` with each call (both may be replaced
    between calls), and ``placement(group index, parameter, hyper)`` where it plans."""

    def __init__(
        self, algorithms, policy: StatePolicy, settings, store, counts, plans, streams, handed
    ) -> None:
        self.algorithms, self.policy, self._settings = algorithms, policy, settings
        self.store, self._counts = store, counts
        # Cleared when state is made, waited on before bytes are reused, pulled at a step.
        self._plans, self._streams, self._handed_scales = plans, streams, handed

    def format(self, p: Tensor):
        """The format of ``p``'s state: as created, or as it would be created now."""
        fmt = self.store.formats.get(p)
        # A DTensor's numel is global: every rank of its mesh picks the same format (Muon
        # batches, and so the collectives, are keyed on it), however small its own shard.
        return fmt if fmt is not None else self.policy.format_for(p)

    def plan_bytes(self, param: Tensor, hyper: Hyper) -> int:
        """State bytes for budgeting and for the resident budget, equal on every rank: a
        sharded (DTensor) parameter counts its global state over the mesh size, never its
        local shard, which differs across ranks when shards are uneven."""
        algorithm, fmt = self.algorithms[hyper.algorithm], self.format(param)
        shape = param.shape if isinstance(param, DTensor) else local(param).shape
        # Each key's own elements: its algorithm's shape (``Algorithm.state_shapes``).
        total = sum(fmt.nbytes(math.prod(k.shape), 1) for k in algorithm.state_shapes(shape))
        if not isinstance(param, DTensor):
            return total
        return -(-total // param.device_mesh.size())

    def budget_bytes(self, param: Tensor, hyper: Hyper) -> int:
        """What ``param`` counts against ``chunk_bytes`` / ``resident_chunk_bytes``: its
        algorithm's rule (``Algorithm.budget_bytes``) on its state bytes, with the global
        element count and the mesh size, so that every rank counts the same."""
        mesh = param.device_mesh.size() if isinstance(param, DTensor) else 1
        algorithm = self.algorithms[hyper.algorithm]
        return algorithm.budget_bytes(self.plan_bytes(param, hyper), param.numel(), mesh)

    def cut_matrices(self, p: Tensor, hyper: Hyper) -> int:
        """How many matrices the planner may cut a matrix parameter's state into when it is
        over budget (``ParamInfo.matrices``): its algorithm's (``Algorithm.matrices``: Muon's
        stack, each matrix orthogonalized on its own); 1 keeps it whole, as for a DTensor,
        whose collectives take whole local stacks."""
        algorithm = self.algorithms[hyper.algorithm]
        return 1 if isinstance(p, DTensor) else algorithm.matrices(p.shape, hyper)

    def param_info(self, index, gi, p: Tensor, hyper: Hyper, resident, placement, grad_dtype=None):
        """The planner's view of ``p`` (``ParamInfo``). A batch of matrices is one launch
        reading one gradient dtype (None: placing state)."""
        fmt = self.format(p)
        return ParamInfo(
            index=index,
            group=gi,
            algorithm=hyper.algorithm,
            elementwise=self.algorithms[hyper.algorithm].elementwise,
            numel=local(p).numel(),
            plan_bytes=self.budget_bytes(p, hyper),
            batch_key=(tuple(p.shape), p.dtype, grad_dtype, fmt, placement(gi, p, hyper)),
            resident=resident,
            align=fmt.align,
            unit_key=fmt,
            matrices=self.cut_matrices(p, hyper),
        )

    def check_quantizable(self, params, gi: int) -> None:
        """Block-scaled state of DTensor parameters: Shard and Replicate placements only."""
        if self.policy.block_scaled():
            check_placements(params, gi)

    def _new_state(self, p: Tensor, hyper: Hyper, streamed: bool) -> NewState:
        algorithm = self.algorithms[hyper.algorithm]
        shape = local(p).shape
        matrices = algorithm.matrices(shape, hyper)
        fmt = self.format(p)
        specs = StatePolicy.specs(fmt, shape, algorithm.state_shapes(shape), matrices)
        return NewState(p, fmt, specs, streamed)

    def check_fits(self, state: dict, work: StepWork, hypers: Sequence[Hyper]) -> None:
        """Each stepped parameter's state has the shapes its algorithm gives the parameter's
        shape now (``Algorithm.state_shapes``; ``hyper.check_state_fits``)."""
        for gi, p in work:
            fmt, algorithm = self.format(p), self.algorithms[hypers[gi].algorithm]
            shapes = {fmt.names(k)[0]: shape for k, _, shape in algorithm.state_shapes(p.shape)}
            check_state_fits(gi, p, state[p], fmt, shapes)

    def for_step(self, state, groups, hypers, work: StepWork, device, placement) -> None:
        """A step's state: 8-bit scales loaded in place into the last ``state_dict()`` copied
        in (``sharded_scales.HandedScales``), state moved to the step's device if the
        parameters moved, state the user assigned adopted (``assigned_state.py``), state
        dropped since made afresh; then none is as created."""
        self._handed_scales.pull()
        self.follow_device(state, groups, hypers, placement, device)
        store = self.store
        dicts = store.index.dicts(state, work.params)
        if store.held.adopt(dicts, work.params, store.streamed, self._streams.synchronize):
            self._plans.clear()  # their layouts and transfers name the replaced tensors
        self.ensure(state, groups, hypers, placement, work)
        store.pristine.clear()

    def follow_device(self, state, groups, hypers, placement, device=None) -> None:
        """State is created with the optimizer, on its parameters' device (resident) or in host
        slabs pinned when they are on a GPU (streamed). Parameters moved since (an optimizer
        built before ``model.to("cuda")``, or on the meta device before ``to_empty``) take
        their state along at the next step or load: it is created afresh for ``device`` (the
        step's; for a load, the one the parameters are on) and the old values and step counts
        are copied in (meta tensors hold none: zeros)."""
        store, pairs = self.store, group_pairs(groups)
        if device is None:
            devices = {local(p).device for _, p in pairs}
            device = devices.pop() if len(devices) == 1 else None
        if device is None or not store.devices or store.devices == {device}:
            return
        old = {p: values for _, p in pairs if (values := state.get(p))}
        counts = {p: self._counts.get(p) for p in old}
        self._streams.synchronize()
        for p in old:
            state[p] = {}  # missing: ``ensure`` forgets it and creates it afresh
        store.host, store.devices = None, set()  # new slabs, pinned as ``device`` needs
        self.ensure(state, groups, hypers, placement)
        for p, values in old.items():
            for name, t in values.items():
                if isinstance(t, Tensor) and name in state[p] and not t.is_meta:
                    local(state[p][name]).copy_(local(t))
        for p, count in counts.items():
            self._counts.set(p, count)

    def ensure(self, state, groups, hypers, placement, work: StepWork | None = None) -> None:
        """Create state for every parameter that has none, in plan order. ``work``: the step's;
        when it holds every parameter, each one's state dict is kept in it (``state_dicts``,
        for the graph's key) and found without hashing (``StateIndex``)."""
        missing = []
        if work is not None and work.complete:
            dicts = self.store.index.dicts(state, work.params)
            if all(dicts):  # every parameter has state: nothing to create
                work.state_dicts = dicts
                return
        for gi, group in enumerate(groups):
            params = group["params"]
            if not all(map(state.get, params)):  # every step: one C-level pass a group
                missing.extend((gi, p) for p in params if not state.get(p))
        if not missing:
            return
        store, infos, settings = self.store, [], self._settings.now
        dropped = [p for _, p in missing if p in store.formats]
        if dropped:
            # No write-back may land in bytes about to be reused (while the store still knows
            # that state is streamed: ``Streams.synchronize`` waits only then).
            self._streams.synchronize()
            store.forget(dropped)
        for i, (gi, p) in enumerate(missing):
            nbytes = self.plan_bytes(p, hypers[gi])
            resident = not settings.offload or (
                settings.resident_bytes is not None
                and store.resident_used + nbytes <= settings.resident_bytes
            )
            if resident and settings.offload:
                store.resident_used += nbytes
                store.resident[p] = nbytes
            infos.append(self.param_info(i, gi, p, hypers[gi], resident, placement))
        plan = plan_step(
            infos,
            settings.chunk_bytes,
            settings.resident_chunk_bytes,
            settings.elementwise_chunk_bytes,
        )
        order = [i for unit in plan.units() for i in unit_params(unit)]
        # A cut parameter appears once per piece; an empty one in no unit at all.
        store.create(
            state,
            [
                self._new_state(missing[i][1], hypers[missing[i][0]], not infos[i].resident)
                for i in dict.fromkeys([*order, *range(len(missing))])
            ],
        )
        self._counts.reset(p for _, p in missing)  # fresh state: no step has updated it
        self._plans.clear()
