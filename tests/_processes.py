"""Start the processes of a multi-process test.

On CPUs (gloo) they fork from a server process that imported torch, the package and the
worker modules once (multiprocessing's "forkserver", preloaded): a fresh interpreter
("spawn") spends ~3 s of CPU importing them, per process, and the distributed tests start
about 80 processes. The server itself runs no test and holds no thread of pytest or xdist, so
the forks are clean. With NCCL (one GPU per process) they are spawned: CUDA does not survive
a fork."""

from __future__ import annotations

import multiprocessing
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

import dist_workers

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "muon_offload",
    "muon_offload.engine.optimizer",
    "dist_workers",
    "dist_workers_int8",
    "dist_workers_in_place",
    "dist_workers_graph",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(fn, world: int, *args):
    """The processes ``fn(rank, world, port, *args)``, not joined."""
    if dist_workers.DEVICE_TYPE == "cuda":
        if world > torch.cuda.device_count():
            pytest.skip(f"needs {world} GPUs, one per process")
        method = "spawn"
    else:
        method = "forkserver"
        multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts
    return mp.start_processes(
        fn, args=(world, free_port(), *args), nprocs=world, join=False, start_method=method
    )


def run(fn, world: int, *args, timeout: float = 180) -> None:
    """Run the processes to the end, with a deadline: a hang (collectives pairing the wrong
    tensors) fails the test instead of blocking it; a process that fails or aborts (SIGABRT)
    fails it too (``ProcessRaisedException``, ``ProcessExitedException``)."""
    context = start(fn, world, *args)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{fn.__name__} did not finish within {timeout} s (hang?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
