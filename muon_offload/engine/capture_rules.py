"""Whether a step can be captured as a CUDA graph, and why not: the rules that
``cuda_graph=True`` enforces (refusing at construction, when a group is added, or when the
parameters moved off CUDA) and that ``"auto"`` reads to run a step eagerly instead.

A graph replays the launches it captured with the values they were given then, so a step can
be captured only where every launch reads what changes from step to step (learning rates,
bias corrections, gradient addresses) from the step's device tables
(``Algorithm.reads_tables``: the Triton kernels do, the torch references take Python numbers),
on parameters on a CUDA device, with no collective of a ``distributed_mesh`` or DTensor."""

from __future__ import annotations

import torch

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
    if mesh_group is not None:
        raise NotImplementedError("cuda_graph=True does not support a distributed_mesh yet")


def group_blocker(group: dict, mesh_group) -> str | None:
    """Why ``"auto"`` keeps every step with this param group eager (None: nothing here)."""
    if mesh_group is not None:
        return "a distributed_mesh"
    if any(isinstance(p, DTensor) for p in group["params"]):
        return "DTensor parameters"
    return None


def auto_blocker(device: torch.device, backend: str, algorithms) -> str | None:
    """Why ``"auto"`` keeps a step on ``device`` eager (None: it may capture)."""
    if device.type != "cuda":
        return f"parameters on {device}"
    if not replays(algorithms, backend, device):
        return f"the {backend} backend"
    return None


def check_group(group: dict, index: int, mesh_group) -> None:
    """A param group ``cuda_graph=True`` cannot capture: refused when it is added."""
    if mesh_group is not None:
        raise NotImplementedError(
            f"param group {index}: cuda_graph=True does not support a distributed_mesh yet"
        )
    for p in group["params"]:
        if isinstance(p, DTensor):
            raise NotImplementedError(
                f"param group {index}: cuda_graph=True does not support DTensor parameters yet"
            )
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
