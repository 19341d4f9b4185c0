"""What the engine asks of an algorithm: the per-unit update.

The engine (``optimizer.py``) owns state, plans, streams and interruption; an algorithm owns
the math of one unit, as dion's ``muon.py`` supplies its tasks over ``megabatch_base.py``.
``Muon`` (``optim/muon.py``) and the element-wise rules (``optim/elementwise.py``) implement it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..distributed import Mesh, Placement, sharded_dims
from ..kernels._grad_index import GradIndex
from .decoded import decoded_update
from .state_format import Dense, StateFormat

DENSE = Dense(torch.float32)
LOCAL_PLACEMENT = Placement("local")  # updated where it is: no communication

# ``backend``: where the launches run. "auto": the Triton kernels for CUDA tensors, the torch
# references elsewhere; "triton": the kernels everywhere (on the CPU under the Triton
# interpreter); "torch": the references everywhere.
BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class Hyper:
    """One group's hyper-parameters for one step, as plain Python numbers."""

    algorithm: str
    lr: float
    weight_decay: float
    mu: float = 0.0
    beta1: float = 0.0
    beta2: float = 0.0
    eps: float = 0.0
    nesterov: bool = False
    adjust_lr: str | None = None
    flatten: bool = False
    split_sizes: tuple[int, ...] | None = None
    num_heads: int | None = None  # dion's per-head split of 2-D weights (optim/muon_shapes.py)
    # dion's cautious weight decay: decay only where the update and the parameter agree in sign
    cautious_wd: bool = False


def runs_triton(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` launches the Triton kernels for tensors on ``device``."""
    return backend == "triton" or (backend == "auto" and device.type == "cuda")


def common_backends(algorithms: Iterable[Algorithm]) -> tuple[str, ...]:
    """The ``backend`` settings that every one of ``algorithms`` takes."""
    algorithms = list(algorithms)
    first = algorithms[0].backends if algorithms else BACKENDS
    return tuple(b for b in first if all(b in a.backends for a in algorithms))


def reads_tables(algorithms: Iterable[Algorithm], backend: str, device: torch.device) -> bool:
    """Whether a step on ``device`` needs the scalar and gradient tables: some algorithm's
    launches read them (``Algorithm.reads_tables``)."""
    return any(a.reads_tables(backend, device) for a in algorithms)


class StateKey(NamedTuple):
    """One state key a parameter holds (``Algorithm.state_shapes``): its name, its kind (8-bit
    state's code map) and the shape of its tensor (the format's first tensor of it)."""

    key: str
    kind: str
    shape: torch.Size


@dataclass(frozen=True)
class UnitJob:
    """One unit's inputs for one step.

    ``params``: for a matrix algorithm the parameters as the user gave them (DTensors stay
    DTensors: their global shape and placement matter); for an element-wise one the flat
    segments of the local tensors being updated. ``grads`` match ``params`` (local tensors;
    flat segments for element-wise units). ``state[k][i]`` is state key ``k`` of item ``i``,
    local, already on the device (a staging view when the state is streamed). ``scalars``:
    on the Triton path, this step's values of ``Algorithm.scalars`` as an fp32 device tensor
    that the kernels read (``engine/scalars.py``); None on the torch path, which takes the
    Python numbers of ``hyper``. ``grad_index``: on the Triton path, where the kernels read
    the gradients' addresses (this step's gradient table, ``engine/grad_table.py``): one row
    a piece of ``grads`` as ``Algorithm.grad_pieces`` cuts them, in order; None where the
    launchers read the gradients' own addresses. ``state`` holds, for each key in turn, one
    list a tensor of ``fmt.names(key)``."""

    group: int
    hyper: Hyper
    # The step count, this step included: for an algorithm that counts steps per parameter
    # (``Algorithm.counts_steps``) the unit's parameters' own, which they share (a unit holds
    # parameters of one count: ``step_counts.py``); else the group's.
    step: int
    backend: str
    mesh: Mesh
    params: list[Tensor]
    grads: list[Tensor]
    state: list[list[Tensor]]
    # The state's format (``state_format.py``): which tensors ``state`` holds a key (one a
    # key dense, codes then scales 8-bit) and the kernel family that steps them.
    fmt: StateFormat = DENSE
    scalars: Tensor | None = None
    plain: bool = False  # no DTensor among the parameters: local(p) is p
    grad_index: GradIndex | None = None
    # A resident unit's dict for the life of its plan (``chunks.UnitLayout``): where the
    # algorithm keeps what it derives from the unit's parameters and state between steps,
    # checked against them at each use (a parameter's storage may be replaced under a plan).
    # A streamed unit's lives with its chunk's staging views (``StreamScheduler.chunk_memo``:
    # emptied when they change, so that nothing kept holds an arena a larger plan replaced).
    # None outside a step and where the step updates copies of its parameters.
    memo: dict | None = None


class Algorithm:
    """Base of the per-unit updates. ``elementwise`` algorithms may see a parameter cut into
    segments anywhere; the others always get whole parameters, batched by shape."""

    name: str = ""
    elementwise: bool = True
    # Whether ``scalars`` reads each parameter's own step count (AdamW's bias correction, as
    # torch's AdamW and dion count): the engine then keeps, for each parameter, the count of
    # the steps that updated it, and checkpoints carry it (``step_counts.py``).
    counts_steps: bool = False

    # What each state key holds, for 8-bit state's code map (kernels/quant_maps.py).
    state_kinds: tuple[str, ...] = ()
    # The ``backend`` settings its launchers take (checked at construction: settings.py).
    backends: tuple[str, ...] = BACKENDS
    # The state formats' kernel families (``StateFormat.kernels``) that ``update`` steps with
    # kernels of its own; state of any other format is decoded around the dense update
    # (``run``, ``decoded.py``).
    kernels: tuple[str, ...] = ("dense",)

    def __init__(self, state_keys: tuple[str, ...]):
        self.state_keys = tuple(state_keys)
        if len(self.state_kinds) != len(self.state_keys):
            raise ValueError(f"{type(self).__name__}: one state kind a key")

    def state_shapes(self, shape: torch.Size) -> tuple[StateKey, ...]:
        """The state keys a parameter of ``shape`` holds, in allocation order, with their kinds
        and shapes: every one of ``state_keys``, shaped like the parameter, unless the algorithm
        keeps statistics of other shapes (a factored second moment: a row and a column vector
        of a matrix; tests/test_algorithm_plugin.py). ``shape``: the local shape for the tensors
        made, the global one for budgets and checks (the same for a plain tensor). Keys not
        shaped like the parameter are for whole-parameter (not ``elementwise``) algorithms, of
        plain tensors and dense state: segments, stack cuts and block scales view a tensor of
        the parameter's shape."""
        shape = torch.Size(shape)
        return tuple(
            StateKey(key, kind, shape)
            for key, kind in zip(self.state_keys, self.state_kinds, strict=True)
        )

    def matrices(self, shape: torch.Size, hyper: Hyper) -> int:
        """How many matrices a parameter of ``shape`` in a group read as ``hyper`` is to the
        update: a block-scaled state counts its blocks per matrix, and the planner may cut a
        parameter over budget between them (``ParamInfo.matrices``; never a DTensor's, whose
        collectives take whole local stacks). 1, the default: one piece, never cut, as an
        algorithm needs whose statistics span the whole parameter (a factored second moment's
        row and column means). Element-wise algorithms are cut anywhere instead."""
        return 1

    def scalars(self, hyper: Hyper, step: int, shape: tuple | None) -> tuple[float, ...]:
        """The runtime scalars of a unit's launches this step (``UnitJob.scalars`` on the
        device), computed as the kernels' launchers compute them from Python numbers.
        ``step``: as ``UnitJob.step``.
        ``shape``: the unit's matrix shape (global) for matrix algorithms, None otherwise."""
        raise NotImplementedError

    def grad_pieces(self, hyper: Hyper, shape: tuple) -> tuple[int, ...]:
        """The element offsets, within one item's gradient (``shape``: the parameter's; an
        element-wise item is a flat segment), of the pieces that ``update`` hands its kernels,
        in that order: the rows of ``UnitJob.grad_index``. One, the whole item, unless the
        algorithm cuts it (Muon: a stack into matrices)."""
        return (0,)

    def reads_tables(self, backend: str, device: torch.device) -> bool:
        """Whether its launches on ``device`` read the step's scalar and gradient tables
        (``UnitJob.scalars``, ``UnitJob.grad_index``): the Triton kernels do; the torch
        references take Python numbers and the gradients as tensors."""
        return runs_triton(backend, device)

    def placement(self, param: Tensor, mesh: Mesh, hyper: Hyper, where: str) -> Placement:
        """How ``param`` is updated across ranks (checked when its group is added; raises for
        a layout the algorithm cannot serve, ``where`` naming it). By default where it is
        (``LOCAL_PLACEMENT``): an element-wise rule on its local tensor, any whole-parameter
        rule on a plain or replicated one; a whole-parameter rule needs a rule of its own
        (Muon's collectives) for a DTensor sharded across ranks."""
        if not self.elementwise and isinstance(param, DTensor) and sharded_dims(param):
            raise NotImplementedError(
                f"{where}: {self.name or type(self).__name__} updates whole parameters and "
                f"has no rule for a DTensor sharded across ranks ({param.placements})"
            )
        return LOCAL_PLACEMENT

    def budget_bytes(self, state_bytes: int, numel: int, mesh_size: int) -> int:
        """What a parameter counts against ``chunk_bytes`` / ``resident_chunk_bytes``, from its
        state bytes (over the mesh for a DTensor), its global element count and its mesh's
        size (1 for a plain tensor): the state bytes themselves, unless the algorithm's work
        on the GPU outgrows its state."""
        return state_bytes

    def baked(self, hyper: Hyper) -> tuple:
        """What of a group's settings the launches take as constants (compile-time flags, host
        choices): a captured graph holds them, and is captured again when they change."""
        return ()

    def run(self, job: UnitJob) -> Iterator[None] | None:
        """What the engine calls: ``update``, or ``update`` on decoded state where the unit's
        format has no kernels here (``decoded.py``)."""
        if job.fmt.kernels in self.kernels:
            return self.update(job)
        return decoded_update(self, job)

    def update(self, job: UnitJob) -> Iterator[None] | None:
        """Update the unit's weights and state in place. A generator (yielding while a
        collective is in flight, dion's pattern) or a plain function returning None."""
        raise NotImplementedError
