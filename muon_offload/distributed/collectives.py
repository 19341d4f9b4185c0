"""Distributed Muon: which parameters need communication, and dion's collectives for them.

Follows dion's pattern (microsoft/dion, ``megabatch_base.py``): each Muon unit is a generator
that launches a collective with ``async_op=True`` and yields, so the small runtime below
starts the next unit's work while the collective is in flight.

- A matrix sharded along one of its two matrix dims (FSDP2: dim 0) is assembled by an
  all-to-all: the unit's matrices are split into world-size batches, rank r receives every
  rank's shard of batch r, orthogonalizes whole matrices, and a second all-to-all sends the
  shards back. Shards are padded to ceil(global / world) along the sharded dim, so uneven
  and empty shards (FSDP2's contiguous chunking) still give uniform all-to-alls.
- A replicated matrix (plain tensors under DDP, or a Replicate DTensor): each rank
  orthogonalizes its share of the unit and an all-gather shares the results.
- A stack of matrices sharded along its batch dim needs nothing: every local matrix is whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

try:  # DTensor is part of torch.distributed, which some builds leave out
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
except ImportError:  # pragma: no cover
    DeviceMesh = DTensor = ()


@dataclass(frozen=True)
class Mesh:
    """A 1-D process group as the optimizer uses it."""

    group: object | None  # ProcessGroup, or None on one device
    rank: int = 0
    size: int = 1
    device_mesh: object | None = None  # the DeviceMesh it came from, if any


LOCAL = Mesh(None)


def resolve_mesh(mesh) -> Mesh:
    """dion's ``distributed_mesh``: a 1-D DeviceMesh, a ProcessGroup, or None."""
    if mesh is None:
        return LOCAL
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"distributed_mesh must be 1-D, got a {mesh.ndim}-D DeviceMesh; for HSDP pass "
                "the sharded sub-mesh"
            )
        return Mesh(mesh.get_group(), mesh.get_local_rank(), mesh.size(), mesh)
    if isinstance(mesh, dist.ProcessGroup):
        return Mesh(mesh, dist.get_rank(mesh), dist.get_world_size(mesh))
    raise TypeError(
        f"distributed_mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}"
    )


def local(t: Tensor) -> Tensor:
    """The tensor this rank holds. Reads the DTensor's local tensor directly: ``to_local()``
    goes through autograd and costs microseconds per call, thousands of times a step."""
    if isinstance(t, DTensor):
        inner = getattr(t, "_local_tensor", None)
        return inner if inner is not None else t.to_local()
    return t


def dtensor_around(local_tensor: Tensor, like: DTensor) -> DTensor:
    """A DTensor laid out like ``like`` whose local tensor is ``local_tensor`` itself, wherever
    it lives. FSDP2 builds its CPU-offloaded shards this way (``_from_local_no_grad``);
    ``DTensor.from_local`` would copy a host tensor to the mesh's device type."""
    return dtensor_of(local_tensor, like.device_mesh, like.placements, like.shape, like.stride())


def dtensor_of(local_tensor: Tensor, mesh, placements, shape, stride=None) -> DTensor:
    """A DTensor of global ``shape`` (contiguous unless ``stride``) placed on ``mesh`` whose
    local tensor is ``local_tensor`` itself, as ``dtensor_around`` (no copy, no move)."""
    if stride is None:
        stride = torch.empty(shape, device="meta").stride()
    meta = TensorMeta(torch.Size(shape), tuple(stride), local_tensor.dtype)
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local_tensor, spec, requires_grad=False)


@dataclass(frozen=True)
class Placement:
    """How a Muon parameter's matrices are laid out across the mesh."""

    kind: str  # "local" (whole on this rank, no communication), "replicated", "sharded"
    comm_dim: int | None = None  # negative matrix dim the shards are cut along
    global_size: int | None = None  # the unsharded size along comm_dim


def sharded_dims(p) -> list[tuple[int, object]]:
    """(mesh dim, placement) of each ``Shard`` of DTensor ``p`` over more than one rank."""
    return [
        (i, pl) for i, pl in enumerate(p.placements) if pl.is_shard() and p.device_mesh.size(i) > 1
    ]


def placement_of(
    p: Tensor, mesh: Mesh, flatten: bool, where: str, num_heads: int | None = None
) -> Placement:
    """Classify a Muon parameter; raise on layouts the collectives cannot serve.
    ``num_heads``: a 2-D weight updated head by head (dion's), which a shard serves only where
    it holds whole heads: dim 0 sharded over a mesh whose size divides ``num_heads``, as dion
    requires; its heads are then orthogonalized where they are, with no collective."""
    if not isinstance(p, DTensor):
        return Placement("replicated" if mesh.group is not None else "local")
    if mesh.device_mesh is None:
        raise ValueError(f"{where}: DTensor parameters need a DeviceMesh as distributed_mesh")
    shards = sharded_dims(p)
    if len(shards) > 1:
        raise ValueError(f"{where}: sharded on more than one dim ({p.placements}); not supported")
    if not shards:
        return Placement("replicated" if mesh.size > 1 else "local")
    mesh_dim, shard = shards[0]
    if p.device_mesh.get_group(mesh_dim) != mesh.group:
        raise ValueError(
            f"{where}: DTensor is sharded over a mesh ({p.device_mesh}) other than its param "
            f"group's ({mesh.device_mesh})"
        )
    dim = shard.dim % p.ndim
    if num_heads is not None:
        if dim != 0:
            raise NotImplementedError(
                f"{where}: num_heads needs the parameter sharded on dim 0 (the heads) or not "
                f"at all, got {p.placements}"
            )
        world = p.device_mesh.size(mesh_dim)
        if num_heads % world:
            raise ValueError(
                f"{where}: num_heads ({num_heads}) must be a multiple of the mesh size "
                f"({world}), so that every shard holds whole heads"
            )
        return Placement("local")
    if flatten:
        if dim != 0:
            raise ValueError(f"{where}: with flatten=True only dim 0 may be sharded, got {dim}")
        return Placement("sharded", -2, p.shape[0])
    if dim >= p.ndim - 2:
        return Placement("sharded", dim - p.ndim, p.shape[dim])
    return Placement("local")  # batch dim sharded: every local matrix is whole


def check_ranks_agree(param_groups: list[dict], mesh_of: Callable[[int], Mesh]) -> None:
    """Every rank of a mesh must hold the same parameters (global shapes and dtypes) in the
    same groups, or the collectives would pair the wrong tensors. Checked once, at
    construction and when a group is added, before any step's collective."""
    meshes: dict[int, tuple[Mesh, list[int]]] = {}
    for gi in range(len(param_groups)):
        mesh = mesh_of(gi)
        if mesh.group is not None:
            meshes.setdefault(id(mesh.group), (mesh, []))[1].append(gi)
    for mesh, group_indices in meshes.values():
        mine = [
            (gi, param_groups[gi].get("algorithm"), tuple(p.shape), str(p.dtype))
            for gi in group_indices
            for p in param_groups[gi]["params"]
        ]
        everyone = [None] * mesh.size
        dist.all_gather_object(everyone, mine, group=mesh.group)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                diff = next(
                    (a, b) for a, b in zip(mine + [None], theirs + [None], strict=False) if a != b
                )
                raise ValueError(
                    f"parameters differ across ranks: this rank (rank {mesh.rank}) has "
                    f"{diff[0]}, rank {rank} has {diff[1]} (group, algorithm, shape, dtype)"
                )


Orthogonalize = Callable[[Tensor, Tensor | None], Tensor]


def orthogonalize_sharded(
    update: Tensor, placement: Placement, mesh: Mesh, orthogonalize: Orthogonalize
) -> Generator[None, None, Tensor]:
    """All-to-all the local shards [N, *local] into whole matrices, orthogonalize, send back."""
    n, world, comm_dim = update.shape[0], mesh.size, placement.comm_dim
    pad_n = -n % world
    if pad_n:
        update = torch.cat([update, update.new_zeros(pad_n, *update.shape[1:])])
    per_rank = update.shape[0] // world
    padded = -(-placement.global_size // world)
    local_size = update.size(comm_dim)
    if local_size > padded:
        raise RuntimeError(
            f"local shard of {local_size} along dim {comm_dim} exceeds ceil(global / world) = "
            f"{padded}: not FSDP2's contiguous sharding"
        )
    if local_size < padded:
        pad = [0, 0] * (-comm_dim - 1) + [0, padded - local_size]
        update = torch.nn.functional.pad(update, pad)
    # all_to_all_single on [world, per_rank, ...] buffers: block r goes to rank r, block r of
    # the result came from rank r. Not the list form (dist.all_to_all): gloo has it only
    # since pytorch PR 165435 (merged 2026-04, after torch 2.11), and with torch 2.11 + gloo
    # the list form failed in this function (2026-11-30); NCCL has both.
    sends = update.unflatten(0, (world, per_rank)).contiguous()
    recvs = torch.empty_like(sends)
    work = dist.all_to_all_single(recvs, sends, group=mesh.group, async_op=True)
    yield
    work.wait()
    whole = orthogonalize(torch.cat(recvs.unbind(0), dim=comm_dim), None)
    sends = torch.stack(torch.tensor_split(whole, world, dim=comm_dim))
    recvs = torch.empty_like(sends)
    work = dist.all_to_all_single(recvs, sends, group=mesh.group, async_op=True)
    yield
    work.wait()
    return recvs.narrow(comm_dim, 0, local_size).flatten(0, 1)[:n]


def orthogonalize_replicated(
    update: Tensor, sumsq: Tensor, mesh: Mesh, orthogonalize: Orthogonalize
) -> Generator[None, None, Tensor]:
    """Each rank orthogonalizes its share of the batch; an all-gather shares the results."""
    n, world = update.shape[0], mesh.size
    if n == 1 or world == 1:
        return orthogonalize(update, sumsq)
    pad_n = -n % world
    if pad_n:
        update = torch.cat([update, update.new_zeros(pad_n, *update.shape[1:])])
        sumsq = torch.cat([sumsq, sumsq.new_zeros(pad_n)])
    per_rank = update.shape[0] // world
    mine = slice(mesh.rank * per_rank, (mesh.rank + 1) * per_rank)
    result = orthogonalize(update[mine], sumsq[mine]).contiguous()
    gathered = [torch.empty_like(result) for _ in range(world)]
    work = dist.all_gather(gathered, result, group=mesh.group, async_op=True)
    yield
    work.wait()
    return torch.cat(gathered)[:n]


def run_tasks(tasks: Iterable[Generator], max_concurrent: int = 3) -> None:
    """dion's AsyncRuntime: each round starts at most one new task and advances every running
    one by a step. The order in which collectives are issued depends only on the sequence of
    tasks, which is the same on every rank."""
    tasks = iter(tasks)
    running: deque[Generator] = deque()
    more = True
    while more or running:
        started = None
        if more and len(running) < max_concurrent:
            started = next(tasks, None)
            more = started is not None
        for _ in range(len(running)):
            task = running.popleft()
            if _advance(task):
                running.append(task)
        if started is not None and _advance(started):
            running.append(started)


def _advance(task: Generator) -> bool:
    try:
        next(task)
        return True
    except StopIteration:
        return False
