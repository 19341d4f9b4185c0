"""8-bit scales of DTensor (sharded) parameters at the checkpoint boundary.

Each rank keeps the codes and scales of its own shard only, with its blocks counted over that
shard as over a whole tensor: element-wise state from the shard's first element, Muon's
momentum over each local matrix's elements, row-major (``state_format.Int8``). The codes are
a DTensor laid out like the parameter. The scales cannot be: a rank's count of blocks follows
its shard's size, and uneven shards give counts that no DTensor sharding of one scale vector
describes. Inside the engine they are plain local tensors.

``state_dict()`` hands them out *rank-major*: a DTensor of global shape
``[n_0, ..., n_k-1, *padded]``, one leading dim for each mesh dim the parameter is sharded
over (of that mesh dim's size), then this rank's scales zero-padded to the shape the largest
shard needs (from global sizes, the same on every rank); ``Shard(j)`` on the j-th such mesh
dim, ``Replicate`` on the others. Every rank owns exactly its own row, which
``torch.distributed.checkpoint`` saves and loads like any sharded tensor, and
``load_state_dict`` strips the leading dims and the padding again. A parameter sharded over
no mesh dim (replicated) has the whole tensor's scales, unpadded.

Those rows are copies, not the live scales: ``HandedScales`` keeps the rows of the last
``state_dict()`` and copies those written in place (``dcp.load(opt.state_dict())`` without
``load_state_dict``, as torch's optimizers allow, since their state dicts hold the live
tensors) into the live scales at the next step or ``state_dict()``, so that such a load restores
the scales with the codes. A row written after that step is not read.

Where blocks fall depends on where shards begin, hence on the world size: an 8-bit checkpoint
of sharded parameters loads on a mesh of the shape it was saved from. To move it elsewhere,
load it into an optimizer with dense state there (it is dequantized), save that, and load the
dense checkpoint anywhere (it is quantized on load).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..distributed import DTensor, dtensor_of, local

try:
    from torch.distributed.tensor import Replicate, Shard
except ImportError:  # pragma: no cover: builds without torch.distributed
    Replicate = Shard = ()


def check_placements(params, index: int) -> None:
    """8-bit state lays out scales for Shard and Replicate placements only (the max shard
    of a strided or partial one is not computed here): refuse others at construction."""
    for p in params:
        if not isinstance(p, DTensor):
            continue
        odd = [pl for pl in p.placements if type(pl) is not Shard and type(pl) is not Replicate]
        if odd:
            raise ValueError(
                f"param group {index} (parameter of shape {tuple(p.shape)}): state_dtype="
                f"torch.int8 supports DTensor parameters placed with Shard and Replicate only, "
                f"not {odd}; use torch.bfloat16 state"
            )


def _sharded_mesh_dims(p: DTensor) -> list[int]:
    return [i for i, pl in enumerate(p.placements) if pl.is_shard()]


def largest_shard_shape(p: DTensor) -> torch.Size:
    """The shape of the largest local shard of ``p`` on any rank: torch chunks a dim of n over
    m ranks into pieces of ceil(n / m), nested shards of one dim piece by piece."""
    shape = list(p.shape)
    for i, pl in enumerate(p.placements):
        if pl.is_shard():
            dim = pl.dim % p.ndim
            shape[dim] = -(-shape[dim] // p.device_mesh.size(i))
    return torch.Size(shape)


def rank_major(scales: Tensor, p: DTensor, padded: torch.Size) -> DTensor:
    """This rank's scales (local) as the rank-major DTensor described above. ``padded``: the
    scales shape of the largest shard (``largest_shard_shape``), which holds every rank's."""
    sharded = _sharded_mesh_dims(p)
    mesh = p.device_mesh
    if len(padded) == 2 and scales.ndim == 1:  # a stack's shard of one matrix, or of none
        scales = scales.reshape(-1, padded[1])
    if not sharded:
        row = scales  # replicated: the whole tensor's scales, as they live
    else:
        row = scales.new_zeros((1,) * len(sharded) + tuple(padded))
        row[(0,) * len(sharded) + tuple(slice(0, n) for n in scales.shape)] = scales
    placements = [
        Shard(sharded.index(i)) if i in sharded else Replicate() for i in range(mesh.ndim)
    ]
    shape = [mesh.size(i) for i in sharded] + list(row.shape[len(sharded) :])
    return dtensor_of(row, mesh, placements, torch.Size(shape))


def strip_rank_dims(scales: Tensor, where: str) -> Tensor:
    """A loaded scales tensor as this rank's (padded) scales: a rank-major DTensor loses its
    leading dims; a plain tensor is taken as it is."""
    if not isinstance(scales, DTensor):
        return scales
    mine = local(scales)
    shards = [pl for pl in scales.placements if pl.is_shard()]
    lead = len(shards)
    if any(pl.dim != j for j, pl in enumerate(shards)) or any(n != 1 for n in mine.shape[:lead]):
        raise ValueError(
            f"{where}: 8-bit scales of shape {tuple(scales.shape)} placed {scales.placements} "
            "are not laid out rank-major (a leading dim for each sharded mesh dim, as "
            "state_dict() gives them)"
        )
    return mine.reshape(mine.shape[lead:])


def crop(scales: Tensor, shape: torch.Size, where: str) -> Tensor:
    """This rank's scales out of a padded row: the first ``shape`` of each dim."""
    if tuple(scales.shape) == tuple(shape):
        return scales
    if scales.ndim == 2 and len(shape) == 1 and shape[0] in (0, scales.shape[1]):
        return scales[: min(shape[0], 1)].reshape(shape)  # a stack's shard of one matrix, or none
    if scales.ndim != len(shape) or any(a < b for a, b in zip(scales.shape, shape, strict=True)):
        raise ValueError(
            f"{where}: loaded 8-bit scales of shape {tuple(scales.shape)} cannot hold this "
            f"rank's {tuple(shape)}: saved from another layout (a mesh of another shape?); "
            "8-bit checkpoints of sharded parameters load at the world size they were saved at"
        )
    return scales[tuple(slice(0, n) for n in shape)]


class HandedScales:
    """The rank-major rows the last ``state_dict()`` handed out, each with the live scales it
    copies and its version counter then (an in-place write, as ``dcp.load`` makes, bumps it).
    Held until the next step, ``state_dict()`` or ``load_state_dict()`` (the state dict itself
    may be gone by then: ``dcp.load(opt.state_dict())``); a row written later than that is a
    copy no longer read."""

    def __init__(self) -> None:
        self._rows: list[tuple[Tensor, Tensor, int, int]] = []

    def add(self, row: Tensor, live: Tensor, lead: int) -> None:
        self._rows.append((row, live, row._version, lead))

    @property
    def held(self) -> bool:
        """Whether rows are held (a write into one reaches the live scales at the next step)."""
        return bool(self._rows)

    def pull(self) -> None:
        """Copy every row written since it was handed out into its live scales; forget them."""
        for row, live, version, lead in self._rows:
            if row._version != version:
                mine = row.reshape(row.shape[lead:])
                live.copy_(crop(mine, live.shape, "8-bit scales loaded into a state_dict()"))
        self._rows = []

    def clear(self) -> None:
        """The live scales were loaded (``load_state_dict``): the rows name nothing to restore."""
        self._rows = []


def lay_out(opt, state_dict: dict) -> dict:
    """``state_dict`` with the scales of every 8-bit DTensor parameter made rank-major (each
    entry a new dict: torch's ``state_dict()`` shares them with the live state); the rows that
    copy the live scales are remembered in ``opt._handed_scales`` (``HandedScales``)."""
    state, hypers = state_dict["state"], None
    for i, (gi, p) in enumerate(opt._params()):
        fmt = opt._store.formats.get(p)
        if not isinstance(p, DTensor) or fmt is None or i not in state:
            continue
        hypers = hypers or opt._hypers()  # read once, where some parameter needs them
        largest = largest_shard_shape(p)
        algorithm = opt.algorithms[opt.param_groups[gi]["algorithm"]]
        count = algorithm.matrices(largest, hypers[gi])
        # The side tensors' shapes for the largest shard (``StateFormat.is_side``).
        padded = {
            name: shape
            for key, kind, _ in algorithm.state_shapes(largest)
            for name, shape, _ in fmt.specs(key, largest, kind, count)
            if fmt.is_side(name)
        }
        if not padded:
            continue
        entry = dict(state[i])
        for name, value in entry.items():
            if name in padded:
                entry[name] = laid = rank_major(local(value), p, padded[name])
                row, lead = local(laid), len(_sharded_mesh_dims(p))
                if row.untyped_storage().data_ptr() != local(value).untyped_storage().data_ptr():
                    opt._handed_scales.add(row, local(value), lead)  # a copy, not the live one
        state[i] = entry
    return state_dict
