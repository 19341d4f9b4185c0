"""Every rank of a mesh must step the same parameters.

A gradient that is None on some ranks only makes the ranks skip different parameters, so the
step's collectives pair different matrices: gloo aborts the process (SIGABRT) on a size
mismatch, and with equal shapes rank 0's shard of one matrix is silently orthogonalized with
rank 1's shard of another. ``StepAgreement.check`` catches it at the start of the step, before
anything is touched, with one all-reduce of two int64 on the CPU per mesh and step:

- each rank hashes the positions of its parameters that have a gradient, and those
  gradients' dtypes (the step batches matrices by gradient dtype, so ranks whose dtypes differ
  would pair different batches), into a 63-bit fingerprint ``h`` (blake2b: Python's ``hash()``
  is salted per process);
- an all-reduce with MAX of ``[h, -h]`` gives the largest and the smallest fingerprint of the
  mesh: they are equal, on every rank, exactly when all ranks agree;
- only on a mismatch do the ranks gather their full lists (``all_gather_object``) to name the
  first parameter that has a gradient on some ranks but not on others, or gradients of other
  dtypes on some ranks. Every rank of the mesh
  sees the mismatch, so every rank raises the same ValueError.

The all-reduce runs on a CPU group so that no CUDA tensor is read on the host (a device sync).
A mesh whose group has a gloo backend for CPU tensors (``backend="gloo"``, or
``"cpu:gloo,cuda:nccl"``) is used as it is. For any other group (NCCL) a gloo twin over the
same ranks is created once, at construction, by ``dist.new_group``, which is collective over
the WORLD: every rank must call it for every group, in the same order, even ranks outside the
group. The ranks of a mesh's group differ from rank to rank (FSDP groups {0,1} and {2,3};
expert-parallel groups {0,2} and {1,3}), so constructing a ``StepAgreement`` first gathers
every rank's group ranks over the WORLD, then creates the twins of all distinct groups in
sorted order, on every rank. Hence: every rank of the WORLD must construct the
``StepAgreement`` of a mesh of the same role at the same time, as it does when every rank
builds its optimizer with the same structure of meshes (SPMD). Twins are cached per group, so
a second optimizer on the same mesh creates nothing and communicates nothing at construction.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .collectives import Mesh

# The mesh's group -> its CPU (gloo) group; per process, shared by all optimizers.
_CPU_GROUPS: dict[object, object] = {}


def _has_cpu_gloo(group) -> bool:
    """Whether collectives on CPU tensors over ``group`` go through gloo: its backend config
    is ``"cpu:gloo,cuda:gloo"`` for gloo, ``"cuda:nccl"`` for NCCL, or mixed."""
    return "cpu:gloo" in dist.get_backend_config(group).replace(" ", "").split(",")


def cpu_group(group):
    """A group over the same ranks as ``group`` that runs collectives on CPU tensors: ``group``
    itself when it has gloo, else its gloo twin (created once; collective over the WORLD, see
    the module's docstring)."""
    cached = _CPU_GROUPS.get(group)
    if cached is not None:
        return cached
    if _has_cpu_gloo(group):
        _CPU_GROUPS[group] = group
        return group
    mine = tuple(sorted(dist.get_process_group_ranks(group)))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    twin = None
    for ranks in sorted(set(everyone)):
        made = dist.new_group(list(ranks), backend="gloo")  # every rank, same order
        if ranks == mine:
            twin = made
    _CPU_GROUPS[group] = twin
    return twin


def fingerprint(stepping: Sequence[int], dtypes: Sequence = ()) -> int:
    """A 63-bit digest of the positions and their gradients' dtype names, the same in every
    process (``-h`` fits in int64)."""
    digest = hashlib.blake2b(array("q", stepping).tobytes(), digest_size=8)
    digest.update(" ".join(map(str, dtypes)).encode())
    return int.from_bytes(digest.digest(), "little") >> 1


class StepAgreement:
    """One per mesh (``muon_offload.distributed.Mesh`` with a process group): checks, once per
    step, that every rank of the mesh steps the same parameters."""

    def __init__(self, mesh: Mesh):
        """Collective when the mesh's group has no gloo backend (see the module's docstring):
        all ranks construct the agreements of their meshes in the same order."""
        self.mesh = mesh
        self.group = None  # the CPU group; None when there is nothing to agree on
        # (stepping, dtypes, their fingerprint): usually the same lists as at the last step
        self._last: tuple[list[int] | None, list[str] | None, int] = (None, None, 0)
        if mesh.group is not None and mesh.size > 1:
            self.group = cpu_group(mesh.group)
            self.ranks = dist.get_process_group_ranks(self.group)  # global, in group order

    def check(
        self,
        stepping: Sequence[int],
        describe: Callable[[int], str],
        dtypes: Sequence = (),
    ) -> None:
        """Collective over the mesh, every step. ``stepping``: the positions (in the mesh's
        parameter order, the same on all ranks) of the parameters with a gradient on this
        rank; ``dtypes``: those gradients' dtypes (or their names), in the same order (or
        none): compared as they are each step, named only when they change. Raises
        ValueError naming the first parameter that has a gradient on some ranks but not on
        others, or whose gradients' dtypes differ between ranks."""
        message = self.disagreement(stepping, describe, dtypes)
        if message is not None:
            raise ValueError(message)

    def disagreement(
        self,
        stepping: Sequence[int],
        describe: Callable[[int], str],
        dtypes: Sequence = (),
    ) -> str | None:
        """``check``'s collective: the error message, or None when all ranks agree."""
        if self.group is None:
            return None
        if stepping != self._last[0] or dtypes != self._last[1]:
            self._last = (list(stepping), list(dtypes), fingerprint(stepping, dtypes))
        h = self._last[2]
        both = torch.tensor([h, -h], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        high, neg_low = both.tolist()
        if high == h and neg_low == -h:
            return None
        everyone: list = [None] * len(self.ranks)
        names = [str(d) for d in dtypes]
        dist.all_gather_object(everyone, (list(stepping), names), group=self.group)
        return self._message(everyone, describe)

    def _message(
        self, everyone: list[tuple[list[int], list[str]]], describe: Callable[[int], str]
    ) -> str:
        sets = [set(s) for s, _ in everyone]
        me = dist.get_rank()
        for position in sorted(set().union(*sets)):
            have = [r for r, s in zip(self.ranks, sets, strict=True) if position in s]
            if len(have) < len(sets):
                lack = [r for r in self.ranks if r not in have]
                return (
                    f"{describe(position)} has a gradient on rank{_s(have)} {_join(have)} but "
                    f"not on rank{_s(lack)} {_join(lack)} (global ranks; this is rank {me}): "
                    "every rank of a mesh must step the same parameters, or the collectives "
                    "pair different matrices. Give it a gradient (zeros) on every rank, or set "
                    "it to None on every rank. Nothing was updated."
                )
        # The same positions everywhere: a dtype differs (where every rank sent its dtypes).
        kinds = [dict(zip(s, d, strict=True)) for s, d in everyone if len(d) == len(s)]
        for position in sorted(sets[0]) if len(kinds) == len(sets) else ():
            named = [k[position] for k in kinds]
            if len(set(named)) > 1:
                first = [r for r, n in zip(self.ranks, named, strict=True) if n == named[0]]
                rest = [r for r in self.ranks if r not in first]
                other = named[self.ranks.index(rest[0])]
                return (
                    f"{describe(position)} has a {named[0]} gradient on rank{_s(first)} "
                    f"{_join(first)} but a {other} gradient on rank{_s(rest)} {_join(rest)} "
                    f"(global ranks; this is rank {me}): every rank of a mesh must give a "
                    "parameter gradients of the same dtype, or the step batches other "
                    "matrices on each rank. Nothing was updated."
                )
        return (  # the same sets in another order or with repeats: not from the optimizer
            f"the ranks passed different lists of stepping positions (global ranks "
            f"{self.ranks}: {everyone}); nothing was updated"
        )


def _s(ranks: list[int]) -> str:
    return "s" if len(ranks) > 1 else ""


def _join(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _describe(param_groups: list[dict], group_indices: list[int], position: int) -> str:
    """The parameter at ``position`` of the mesh's order (its groups' parameters in turn)."""
    for gi in group_indices:
        params = param_groups[gi]["params"]
        if position < len(params):
            shape = tuple(params[position].shape)
            return f"param group {gi} (parameter {position} of the group, of shape {shape})"
        position -= len(params)
    raise IndexError(position)


class StepAgreements:
    """An optimizer's agreements: one per process group among its param groups' meshes."""

    def __init__(self):
        self._by_group: dict[int, StepAgreement] = {}

    def add(self, param_groups: list[dict], mesh_of: Callable[[int], Mesh]) -> None:
        """At construction and after ``add_param_group``: the agreements of meshes not seen
        yet, in group order (the same on all ranks)."""
        for gi in range(len(param_groups)):
            mesh = mesh_of(gi)
            if mesh.group is not None and id(mesh.group) not in self._by_group:
                self._by_group[id(mesh.group)] = StepAgreement(mesh)

    def check(self, param_groups: list[dict], mesh_of: Callable[[int], Mesh]) -> None:
        """At the start of ``step()``, before anything is touched: every mesh's check runs
        (so that a rank in two meshes never leaves the second one waiting), then the first
        disagreement raises."""
        errors = []
        for key, agreement in self._by_group.items():
            mine = [gi for gi in range(len(param_groups)) if id(mesh_of(gi).group) == key]
            flat = [p for gi in mine for p in param_groups[gi]["params"]]
            grads = [(i, p.grad) for i, p in enumerate(flat) if p.grad is not None]
            message = agreement.disagreement(
                [i for i, _ in grads],
                lambda i, mine=mine: _describe(param_groups, mine, i),
                [g.dtype for _, g in grads],
            )
            if message is not None:
                errors.append(message)
        if errors:
            raise ValueError(errors[0])
