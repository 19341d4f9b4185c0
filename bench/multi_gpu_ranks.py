"""The process-group side of bench/multi_gpu.py: NVLink multicast kept off, the process group
and meshes, and figures gathered from every rank."""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from muon_offload.tools.bench.timing import GIB, Clock, summary


def keep_multicast_off() -> None:
    """NVLink multicast (NVLS) off in NCCL, PyTorch and NVSHMEM, before any communicator: on
    the shared 8-GPU machines this bench is meant for, a program that uses it can put the
    host's GPUs out of service. Forced, not defaulted, so a stray setting cannot turn it on."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"


def init(device_type: str) -> tuple[torch.device, dict]:
    """The process group (nccl with one GPU per rank, gloo on CPUs) and the meshes: ``dense``
    (FSDP), ``experts`` (expert parallel) and ``adamw`` (the dense one), each of every rank."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a plain `python` run: one process
    os.environ.setdefault("MASTER_PORT", "29512")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    meshes = {
        "dense": init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",)),
        "experts": init_device_mesh(device.type, (world,), mesh_dim_names=("ep",)),
    }
    meshes["adamw"] = meshes["dense"]
    return device, meshes


def everyone(obj) -> list:
    """``obj`` from every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier(clock: Clock) -> None:
    """All ranks leave together, with no device work in flight."""
    clock.sync()
    dist.barrier()
    clock.sync()


def over_ranks(times: list[float], clock: Clock, base: int) -> dict:
    """One mode's figures from every rank, given this rank's step times: per step the slowest
    rank's time; peak memory (absolute, and above ``base``) the highest rank's."""
    peak = clock.peak()
    mine = {
        "times_s": times,
        "peak_gib": peak / GIB if peak is not None else None,
        "peak_added_gib": (peak - base) / GIB if peak is not None else None,
    }
    ranks = everyone(mine)
    slowest = [max(r["times_s"][k] for r in ranks) for k in range(len(times))]
    peaks = [r["peak_gib"] for r in ranks]
    added = [r["peak_added_gib"] for r in ranks]
    return {
        **summary(slowest),
        "times_s": slowest,
        "per_rank_median_s": [statistics.median(r["times_s"]) for r in ranks],
        "peak_gib": max(peaks) if None not in peaks else None,
        "peak_added_gib": max(added) if None not in added else None,
    }
