"""Compiling the kernels a step will launch ahead of it, on a pool of threads.

A first step on a fresh machine is bound by Triton compiling its kernel variants one at a
time (seconds each, twenty for a mixture-of-experts model). Within ``compiling_ahead(device)``,
every Triton launch of this thread only compiles (Triton's ``warmup``: nothing runs on the
GPU), each compile submitted through Triton's ``AsyncCompileMode``; leaving the block waits
for them all. The launches that follow find their binaries in Triton's in-memory cache.

Each compile runs first in one of ``os.cpu_count()`` worker processes (``_compile_worker.py``:
fresh interpreters, no CUDA context), which writes the binary into Triton's disk cache; then
Triton's own compile runs here, on a thread, and finds it there: the same source, signature,
options and environment, so the same cache key and the same binary. Processes, not threads:
triton 3.6's compile holds the GIL (eight variants took as long on two threads as on one;
triton 3.9 releases it in part: 0.74 of the time). That thread then makes the kernel's
launcher (``_launchers.py``: on triton 3.6 a C build its first launch would run in the step).

``compile_then_tune(device, run, what)`` is the pass a first step runs: ``run`` (one callable
a unit) in a block where a key the tuner must time compiles only its candidates' timing
launches, the timing of those keys after it (on the card), and beside that timing, on a
thread, each unit that left keys run again in a second block once they are timed: it compiles
each winner's own launch, on the same worker processes. ``prestart(device)`` starts the
processes early (an optimizer's construction), so that their start is off the first compile's
path.

The launches inside the block must go to scratch tensors with the shapes, dtypes, strides and
alignment of the step's (the variant is read off them): their results are garbage. Only on
CUDA, with a Triton that has ``AsyncCompileMode``, and unless ``MUON_OFFLOAD_PARALLEL_COMPILE=0``;
elsewhere the block changes nothing and the launches run as usual.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch

from . import _launchers
from ._launch import AHEAD, interpreted, launches_only_compile
from ._winners import Winners, this_stream

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


WORKER = (sys.executable, "-m", "muon_offload.kernels._compile_worker")


def _worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # ``python -m`` puts the working directory first on the worker's path: a folder named
    # muon_offload there (a source checkout installed elsewhere) would be imported in place of
    # the package this process runs, and every job fail. Python 3.11 on leaves it out.
    env["PYTHONSAFEPATH"] = "1"
    return env


def _job(compile_fn: Callable) -> tuple | None:
    """The picklable job of one of Triton's compile closures (``JITFunction._do_compile``'s
    ``async_compile``: its ``src``, ``target`` and ``options``), or None where the closure
    is not one (another Triton) or the job does not pickle: that one compiles here."""
    names = getattr(getattr(compile_fn, "__code__", None), "co_freevars", ())
    cells = getattr(compile_fn, "__closure__", None) or ()
    try:
        found = {n: c.cell_contents for n, c in zip(names, cells, strict=True)}
        src, target, options = found["src"], found["target"], found["options"]
        kernel = src.fn.fn  # the Python function of the JITFunction
        job = (
            kernel.__module__,
            kernel.__name__,
            src.signature,
            src.constants,
            src.attrs,
            target,
            dict(options.__dict__),
        )
        pickle.dumps(job)
    except Exception:  # noqa: BLE001 (any shape of closure: compile in this process)
        return None
    return job


class Workers:
    """``count`` worker processes (``_compile_worker.py``), each fed one job at a time by a
    thread of its own; each process starts with its thread, so they start in parallel, and
    imports Triton and the kernel modules before its first job comes (about as long as a
    compile: off the first compile's path when the pool starts early, ``prestart``)."""

    def __init__(self, count: int, command: tuple = WORKER) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._command = command
        self.env = _worker_env()  # as it was at the start: Triton's cache dir among it
        self._threads = [
            threading.Thread(target=self._serve, name=f"muon-offload-compile-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: tuple) -> Future:
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def _start(self) -> subprocess.Popen:
        pipe = subprocess.PIPE
        return subprocess.Popen(self._command, stdin=pipe, stdout=pipe, env=self.env)

    def _serve(self) -> None:
        try:
            proc = self._start()
        except OSError:  # started again for the first job, whose error it then is
            proc = None
        while (item := self._jobs.get()) is not None:
            job, future = item
            try:
                if proc is None:
                    proc = self._start()
                pickle.dump(job, proc.stdin)
                proc.stdin.flush()
                future.set_result(pickle.load(proc.stdout))
            except Exception as err:  # noqa: BLE001 (a dead worker: the launch compiles it)
                future.set_result(f"{type(err).__name__}: {err}")
                proc = None
        if proc is not None:
            proc.stdin.close()
            proc.wait()

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()


class CompileExecutor(Executor):
    """What ``AsyncCompileMode`` submits Triton's compile closures to: each compile runs in a
    worker process first (Triton's compile holds the GIL in triton 3.6, so threads alone
    compile one at a time), then the closure runs on a thread here and finds the binary in
    the disk cache; a closure without a job runs on the thread as it is."""

    def __init__(self, count: int, command: tuple = WORKER, workers: Workers | None = None):
        self.workers = Workers(count, command) if workers is None else workers
        self._threads = ThreadPoolExecutor(count, thread_name_prefix="muon-offload-load")
        self.submitted = 0  # compiles (variants) submitted
        self.launchers = 0  # of their kernels' launchers made (``_launchers.build``)
        self._counted = threading.Lock()
        self.keep = False  # shutdown leaves the worker processes running (for another block)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        self.submitted += 1
        job = _job(fn) if not (args or kwargs) else None
        ahead = None if job is None else self.workers.submit(job)
        return self._threads.submit(self._load, ahead, fn, *args, **kwargs)

    def _load(self, ahead: Future | None, fn: Callable, *args, **kwargs):
        """Triton's compile (a disk-cache hit after the worker's), then the kernel's launcher
        (a C build on triton 3.6, which its first launch would run in the step)."""
        if ahead is not None:
            ahead.result()  # its error, if any, comes again from fn: the compile that counts
        kernel = fn(*args, **kwargs)
        if _launchers.build(kernel):
            with self._counted:
                self.launchers += 1
        return kernel

    def shutdown(self, wait: bool = True, **kwargs) -> None:
        self._threads.shutdown(wait)
        if not self.keep:
            self.workers.close()


# The worker processes ``prestart`` started, kept for the next block; once a process.
_EARLY: list = [None, False]  # [Workers or None, whether prestart ran]


def prestart(device: torch.device) -> None:
    """Start the worker processes of the next ``compiling_ahead`` block now, in the
    background (an optimizer's construction, on a fresh process: the first step's pass then
    finds them up, their interpreters and imports done). Once a process; nothing where the
    block would not compile ahead."""
    if not enabled(device) or launches_only_compile():
        return
    with _PATCH_LOCK:
        if not _EARLY[1]:
            _EARLY[:] = [Workers(workers()), True]


# A pass's worker processes wait this long for the next pass (another optimizer's first step,
# a mode built after another: seconds later) before they are closed.
PARKED_S = 60.0


def _take_early() -> Workers | None:
    """The processes ``prestart`` or the last pass left, if their environment is today's
    (a worker writes the cache its environment names: another would miss it)."""
    with _PATCH_LOCK:
        early, _EARLY[0] = _EARLY[0], None
    if early is not None and early.env != _worker_env():
        early.close()
        return None
    return early


def _park(processes: Workers) -> None:
    """Keep ``processes`` for the next pass, for ``PARKED_S`` seconds (else close them)."""
    with _PATCH_LOCK:
        parked = _EARLY[0] is None
        if parked:
            _EARLY[0] = processes
    if not parked:
        processes.close()
        return
    timer = threading.Timer(PARKED_S, _expire, args=(processes,))
    timer.daemon = True
    timer.start()


def _expire(processes: Workers) -> None:
    with _PATCH_LOCK:
        mine = _EARLY[0] is processes
        if mine:
            _EARLY[0] = None
    if mine:
        processes.close()


@contextlib.contextmanager
def compiling_ahead(
    device: torch.device, what: str = "kernels", processes: Workers | None = None
) -> Iterator[bool]:
    """Within the block, this thread's Triton launches compile on a thread pool instead of
    running; on leaving it every compile has finished (a failed one raises here, as its launch
    would have). Yields whether it does so (``enabled(device)``); when not, launches run.
    ``processes``: the worker processes to compile on, left running on leaving (else those
    ``prestart`` started, or new ones, closed on leaving). One INFO line on leaving: how many
    variants compiled, in how long."""
    if not enabled(device) or launches_only_compile():
        yield False
        return
    count, start = workers(), time.perf_counter()
    mode = _async_mode()
    _install()
    try:
        pool = CompileExecutor(count, workers=processes or _take_early())
        pool.keep = processes is not None
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
    seconds = time.perf_counter() - start
    line = (
        "muon-offload: compiled %d kernel variants ahead (the %s) in %.1f s, %d processes, "
        "%d launchers made"
    )
    _LOG.info(line, pool.submitted, what, seconds, count, pool.launchers)


def compile_then_tune(device: torch.device, run, what: str) -> bool:
    """``run`` (launches: a callable, or a sequence of them, one a unit) inside
    ``compiling_ahead``, where a key the tuner must time compiles its candidates' timing
    launches only (``AHEAD.pending``); those keys are then timed here, one after another,
    outside the block (on the card, on binaries the block compiled), while another thread
    (``_winners.Winners``) runs again, inside a second block on the same processes, each
    unit that left keys to time, once its keys are timed: it compiles each winner's own
    launch. The step that follows compiles nothing and times nothing, and the launches that
    lose the timing are never compiled. The processes then wait ``PARKED_S`` for the next
    pass. Whether the launches compiled ahead (``enabled(device)``)."""
    from ._launch import TUNER

    if not enabled(device) or launches_only_compile():
        return False
    units = [run] if callable(run) else list(run)
    processes = _take_early() or Workers(workers())
    try:
        AHEAD.pending, owners = [], []  # the keys left to time, the unit that left each
        try:
            with compiling_ahead(device, what, processes):
                for u, unit in enumerate(units):
                    unit()
                    owners += [u] * (len(AHEAD.pending) - len(owners))
            pending = AHEAD.pending
        finally:
            AHEAD.pending = None
        if pending:
            what = f"{len(pending)} tuned keys' winners, beside their timing"
            block = functools.partial(compiling_ahead, device, what, processes)
            with Winners(units, owners, block, this_stream(device)) as winners:
                for n, (kernel, key, configs, *rest) in enumerate(pending):
                    TUNER.choose(kernel, key, configs, *rest)
                    winners.timed(n)
    finally:
        _park(processes)  # for the next pass, a while
    return True
