"""Whether a step can be captured as a CUDA graph, and why not: the rules that
``cuda_graph=True`` enforces (refusing at construction, when a group is added, or when the
parameters moved off CUDA) and that ``"auto"`` reads to run a step eagerly instead.

A graph replays the launches it captured with the values they were given then, so a step can
be captured only where every launch reads what changes from step to step (learning rates,
bias corrections, gradient addresses) from the step's device tables
(``Algorithm.reads_tables``: the Triton kernels do, the torch references take Python numbers),
on parameters on a CUDA device, and where every collective a step issues (over a
``distributed_mesh``, or the meshes of DTensor parameters) runs its CUDA tensors through NCCL,
whose collectives a capture records as graph nodes; gloo's cannot be captured. Pairing across
ranks, and what the sharded path captures by address: ``graphs.py``. Collectives across
processes are captured with ``cuda_graph=True`` only: ``"auto"`` keeps those steps eager (a
one-process mesh captures under both)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import DTensor


def replays(algorithms, backend: str, device: torch.device) -> bool:
    """Whether every algorithm's launches on ``device`` read the step's numbers from the
    scalar and gradient tables (``Algorithm.reads_tables``), so that a replay sees each
    step's: launches that take them as Python numbers (the torch references) would repeat
    the captured step's."""
    return all(a.reads_tables(backend, device) for a in algorithms)


def check_settings(settings, mesh_group, algorithms) -> None:
    """Constructor arguments ``cuda_graph=True`` cannot work with ("auto" runs them eagerly)."""
    if settings.cuda_graph is not True:
        return
    if not replays(algorithms, settings.backend, torch.device("cuda")):
        raise ValueError(
            "cuda_graph=True needs the Triton kernels (backend 'auto' or 'triton'): the torch "
            "references take their hyper-parameters as Python numbers, which a graph would fix"
        )
    why = mesh_blocker(mesh_group, across_processes=True)
    if why is not None:
        raise NotImplementedError(f"cuda_graph=True cannot capture {why}")


def cuda_backend(group) -> str | None:
    """The backend that runs ``group``'s collectives on CUDA tensors (its backend config:
    ``"cuda:nccl"``, ``"cpu:gloo,cuda:gloo"``, ...), None if none does."""
    for entry in dist.get_backend_config(group).replace(" ", "").split(","):
        device, _, backend = entry.rpartition(":")
        if device == "cuda":
            return backend
    return None


def mesh_blocker(
    mesh_group, what: str = "a distributed_mesh", across_processes: bool = False
) -> str | None:
    """Why collectives over ``mesh_group`` are not captured (None: none, or NCCL's). Without
    ``across_processes`` (``"auto"``), NCCL collectives over more than one process are not
    either: ``cuda_graph=True`` asks for them."""
    if mesh_group is None:
        return None
    backend = cuda_backend(mesh_group)
    if backend != "nccl":
        return f"{what} whose CUDA collectives run through {backend or 'no backend'} (not NCCL)"
    size = 1 if across_processes else dist.get_world_size(mesh_group)
    if size > 1:
        return f"{what} of {size} processes (cuda_graph=True captures their collectives)"
    return None


def group_blocker(group: dict, mesh_group, across_processes: bool = False) -> str | None:
    """Why the steps with this param group are not captured (None: nothing here): its mesh,
    or a DTensor parameter's mesh, does not run CUDA collectives through NCCL, or (without
    ``across_processes``: ``"auto"``) spans more than one process."""
    why = mesh_blocker(mesh_group, across_processes=across_processes)
    meshes = {id(p.device_mesh): p.device_mesh for p in group["params"] if isinstance(p, DTensor)}
    for mesh in meshes.values():
        for sub in mesh.get_all_groups():
            why = why or mesh_blocker(sub, "DTensor parameters on a mesh", across_processes)
    return why


def auto_blocker(device: torch.device, backend: str, algorithms) -> str | None:
    """Why ``"auto"`` keeps a step on ``device`` eager (None: it may capture)."""
    if device.type != "cuda":
        return f"parameters on {device}"
    if not replays(algorithms, backend, device):
        return f"the {backend} backend"
    return None


def check_group(group: dict, index: int, mesh_group) -> None:
    """A param group ``cuda_graph=True`` cannot capture: refused when it is added."""
    why = group_blocker(group, mesh_group, across_processes=True)
    if why is not None:
        raise NotImplementedError(f"param group {index}: cuda_graph=True cannot capture {why}")
    for p in group["params"]:
        if p.device.type != "cuda":
            raise ValueError(
                f"param group {index}: cuda_graph=True needs parameters on a CUDA device, got "
                f"one on {p.device}"
            )


def check_device(cuda_graph: bool | str, device: torch.device | None) -> None:
    """With ``True``, a step's parameters must be on CUDA (they may have moved since
    construction)."""
    if cuda_graph is True and device is not None and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs parameters on a CUDA device, not {device}")
