"""Compiling the kernels a step will launch ahead of it, on a pool of threads.

A first step on a fresh machine is bound by Triton compiling its kernel variants one at a
time (seconds each, some twenty of them for a mixture-of-experts model). Within
``compiling_ahead(device)``, every Triton launch of this thread only compiles (Triton's
``warmup``: nothing runs on the GPU), each compile submitted to a pool of threads through
Triton's ``AsyncCompileMode``; leaving the block waits for them all. The launches that follow
find their binaries in Triton's caches (in memory and on disk): Triton's own compile builds
them from the same source, signature and options, so they are the same binaries.

Threads, not processes: Triton's compile spends its time in MLIR and LLVM passes and in
``ptxas``, outside the GIL (two threads compiled four kernels in 0.55x the time of one on a
two-core machine, triton 3.9), and a thread needs no pickling of kernels nor a fresh CUDA
context.

The launches inside the block must go to scratch tensors with the shapes, dtypes, strides and
alignment of the step's (the variant is read off them): their results are garbage. Only on
CUDA, with a Triton that has ``AsyncCompileMode``, and unless ``MUON_OFFLOAD_PARALLEL_COMPILE=0``;
elsewhere the block changes nothing and the launches run as usual.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from ._launch import AHEAD, interpreted, launches_only_compile

ENV = "MUON_OFFLOAD_PARALLEL_COMPILE"
_LOG = logging.getLogger("muon_offload")
_PATCH_LOCK = threading.Lock()
_PATCHED = [0, None]  # blocks open in any thread, JITFunction.run before the first opened


def workers() -> int:
    """Compile threads: one per CPU core (Triton compiles one kernel on one core)."""
    return os.cpu_count() or 1


def _async_mode():
    """Triton's ``AsyncCompileMode``, or None for a Triton without it."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


def enabled(device: torch.device) -> bool:
    """Whether ``compiling_ahead`` compiles in parallel on ``device`` (read per call: no
    device is probed at import)."""
    return (
        os.environ.get(ENV, "1") != "0"
        and device.type == "cuda"
        and not interpreted()
        and _async_mode() is not None
    )


def _install() -> None:
    """Wrap ``JITFunction.run`` (while a block is open) so that the launches of a thread
    inside a block become warm-ups; other threads' launches run as usual."""
    from triton.runtime.jit import JITFunction

    with _PATCH_LOCK:
        if _PATCHED[0] == 0:
            original = JITFunction.run
            _PATCHED[1] = original

            def run(self, *args, grid, warmup, **kwargs):
                warmup = warmup or launches_only_compile()
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)

            JITFunction.run = run
        _PATCHED[0] += 1


def _uninstall() -> None:
    from triton.runtime.jit import JITFunction

    with _PATCH_LOCK:
        _PATCHED[0] -= 1
        if _PATCHED[0] == 0:
            JITFunction.run = _PATCHED[1]
            _PATCHED[1] = None


@contextlib.contextmanager
def compiling_ahead(device: torch.device, what: str = "kernels") -> Iterator[bool]:
    """Within the block, this thread's Triton launches compile on a thread pool instead of
    running; on leaving it every compile has finished (a failed one raises here, as its launch
    would have). Yields whether it does so (``enabled(device)``); when not, launches run."""
    if not enabled(device) or launches_only_compile():
        yield False
        return
    count = workers()
    _LOG.info("muon-offload: compiling the %s of this step ahead on %d threads", what, count)
    mode = _async_mode()
    _install()
    try:
        pool = ThreadPoolExecutor(count, thread_name_prefix="muon-offload-compile")
        try:  # a config that fails to compile is the tuner's to skip, at its launch
            ahead = mode(pool, ignore_errors=True)
        except TypeError:  # a Triton whose mode has no such option
            ahead = mode(pool)
        with pool, ahead:  # the mode's exit waits for the compiles, then the pool's
            AHEAD.on = True
            try:
                yield True
            finally:
                AHEAD.on = False
    finally:
        _uninstall()
