"""Launch helpers shared by the kernel families: the tuner and its disk cache, runtime scalars,
dtypes and size keys. Pointer tables and the segment lists' checks are in ``_tables.py``, what
a CUDA graph capture forbids in ``_capture.py`` (both re-exported here).

Runtime scalars (learning rates, decays, bias corrections, momentum) reach the kernels through
memory, not as arguments: each launcher reads them from a small fp32 device tensor (the
engine's per-step scalar table, or ``device_scalars`` for a direct call), so that a captured
CUDA graph replays with this step's values. Under capture, nothing here may allocate or copy
from the host or time configs: a tuning decision missing there raises ``CaptureMiss`` (the
engine then stays eager).

Tuning runs on scratch tensors of the same sizes and dtypes as the call, never on the
caller's tensors: an in-place update therefore lands exactly once whatever the tuner does.
Results go to a JSON file per GPU name and Triton version (``MUON_OFFLOAD_CACHE_DIR``, else
``~/.cache/muon_offload``). Under the interpreter (``TRITON_INTERPRET=1``) every kernel uses
its single interpreter config and nothing is tuned.

Keys hold size classes (``bucket``, ``shape_classes.py``) and the timing runs on a class's sizes,
so a choice depends on the shape alone; ``shipped_tables.py`` decides keys the cache lacks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from ._capture import CaptureMiss, capturing
from ._tables import (  # noqa: F401  (re-exported: the launchers import them from here)
    ALIGN_BYTES,
    DTYPE,
    SHAPE,
    TABLES,
    Memo,
    TableCache,
    aligned_addresses,
    all_aligned,
    check_lists,
    chunk_rows,
    group_by_dtype,
)
from .config import Config
from .shipped_tables import ShippedTables

# Multiply-add contraction for the kernels that were tested and timed with it (triton's default
# through 3.9; triton 3.10 turns the default off). Passed explicitly so that a kernel's bits do
# not change with the Triton version; the kernels whose results are defined by a fixed order of
# plain operations (sums of squares, 8-bit encoding, Muon prep) pass False.
FP_FUSION = True


def interpreted() -> bool:
    """True when Triton kernels run under the CPU interpreter (read per call, not at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# This thread is inside ``precompile.compiling_ahead``: its launches only compile (``.on``);
# ``.undecided``: the (kernel, key) that the tuner's last choice left to the step; ``.pending``
# (``precompile.compile_then_tune``): where ``choices`` leaves such keys to be timed after
# the block, launching none of their candidates.
AHEAD = threading.local()


def launches_only_compile() -> bool:
    return getattr(AHEAD, "on", False)


def autotune_switched_on() -> bool:
    """``MUON_OFFLOAD_AUTOTUNE`` is not "0" (read per call)."""
    return os.environ.get("MUON_OFFLOAD_AUTOTUNE", "1") != "0"


def autotune_enabled() -> bool:
    return autotune_switched_on() and not interpreted()


# Grid axis 1 (the batch) holds at most this many programs: larger batches launch in slices.
MAX_GRID_Y = 65535


def batch_slices(batch: int) -> list[tuple[int, int]]:
    """(first matrix, matrices) of each launch of a batch along grid axis 1."""
    return [(start, min(batch - start, MAX_GRID_Y)) for start in range(0, batch, MAX_GRID_Y)]


def launch_batched(kernel, programs: int, batch: int, tensors: tuple, *args, **kwargs) -> None:
    """``kernel`` over a batch on a grid (programs, matrices), in as many launches as grid
    axis 1 needs (``batch_slices``): each gets ``tensors``, then the index of its first
    matrix (the kernels' ``b_start``), then ``args`` and ``kwargs``."""
    for start, size in batch_slices(batch):
        kernel[(programs, size)](*tensors, start, *args, **kwargs)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of the launchers' sizes: ``triton.cdiv`` called from host code is a
    ``constexpr_function`` (triton 3.5 on) that unwraps its arguments as a kernel's would,
    a few microseconds a launch."""
    return -(-a // b)


def bucket(n: int) -> int:
    """Next power of two: tuning keys grow by doubling, so new sizes rarely re-tune."""
    return 1 << max(int(n) - 1, 0).bit_length()


def tuning_batch(elements: int) -> int:
    """The batch that kernels whose config changes their results are timed on: fixed by the
    matrix size (about 64 Mi input elements, at most 64 matrices), never the caller's batch,
    so that chunking cannot change which config a shape gets."""
    return max(1, min(64, (1 << 26) // max(int(elements), 1)))


@functools.cache
def triton_dtype(dtype: torch.dtype):
    import triton.language as tl

    table = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if dtype not in table:
        raise TypeError(f"unsupported dtype {dtype}; expected float32, bfloat16 or float16")
    return table[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


_LOG = logging.getLogger("muon_offload")
NOTICE = (
    "muon-offload: timing kernel configs for shapes new to this GPU (seconds a shape class, "
    "once; cached in %s; MUON_OFFLOAD_AUTOTUNE=0 takes each kernel's first config)"
)


class Tuner:
    """Chooses a config per (kernel, key) by timing candidates on scratch data, and caches the
    choice in memory and on disk."""

    def __init__(self) -> None:
        self._memory: dict[str, dict] = {}
        self._shipped = ShippedTables()
        self._said = False  # the first-tuning notice is given once a process
        self._loaded: set[str] = set()
        self._lock = threading.Lock()
        self.last: dict[str, dict] = {}  # kernel -> the latest decision (for `tune` reports)
        self.retune = False  # time the candidates again even when a decision is cached
        self.forced: dict[str, Config] = {}  # kernel -> the config it takes (tuning.forcing)
        # The keys timed since ``retune`` was set (``tuning.retuning``): not timed twice in it
        # (the compile pass times a key, the step after it would again).
        self.retimed: set[tuple] = set()
        # (device index, cache dir, name) -> config: this process's decisions, no lock or I/O
        self._chosen: dict[tuple, Config] = {}

    @staticmethod
    def cache_path(device: torch.device) -> Path:
        import triton

        root = Path(os.environ.get("MUON_OFFLOAD_CACHE_DIR", Path.home() / ".cache/muon_offload"))
        name = _device_name(device.index).replace(" ", "_").replace("/", "_")
        return root / f"tune-{name}-triton{triton.__version__}.json"

    def _load(self, path: Path) -> None:
        key = str(path)
        if key in self._loaded:
            return
        self._loaded.add(key)
        with contextlib.suppress(OSError, ValueError):
            self._memory.update(json.loads(path.read_text()))

    def _notice(self, name: str, path: Path) -> None:
        """Once a process, a warning that tuning runs (where, how to skip); each key at INFO."""
        if not self._said:
            self._said = True
            _LOG.warning(NOTICE, path)
        _LOG.info("muon-offload: tuning %s", name)

    def _save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._memory, indent=1, sort_keys=True))
        tmp.replace(path)

    def choose(
        self,
        kernel: str,
        key: tuple,
        configs: Sequence[Config],
        interpreter_config: Config,
        device: torch.device,
        bench: Callable[[Config], float] | None,
        force: bool = False,
    ) -> Config:
        """``bench(config) -> ms`` must run on scratch tensors (it is called once per config)."""
        if device.type != "cuda" or interpreted():
            return interpreter_config
        if self.forced and kernel in self.forced:
            return _forced(kernel, key, configs, self.forced[kernel])
        # autotune_enabled(), TRITON_INTERPRET not read again: this runs per launch.
        if not force and not autotune_switched_on():
            return configs[0]
        if len(configs) == 1 and not (force or self.retune):
            return configs[0]  # nothing to choose: neither timed nor compiled for a timing
        fast_key = (device.index, os.environ.get("MUON_OFFLOAD_CACHE_DIR"), kernel, key)
        fast = self._chosen.get(fast_key)  # no string building: this runs per launch
        if fast is not None and not (force or (self.retune and fast_key not in self.retimed)):
            return fast
        name = f"{kernel}|" + "|".join(str(k) for k in key)
        with self._lock:
            path = self.cache_path(device)
            self._load(path)
            hit = self._memory.get(name)
        if not (force or self.retune):  # the user's cache, else the package's tables
            pick = functools.partial(_cached_config, configs=configs)
            cached = pick(hit)
            found = (hit, cached) if cached else self._shipped.choice(path.name, name, pick)
            if found is not None:
                self.last[kernel] = {"key": name, **found[0]}
                self._chosen[fast_key] = found[1]
                return found[1]
        if bench is None:
            return configs[0]
        if capturing(device):
            raise CaptureMiss(f"{kernel} was not tuned for {key} before the capture")
        if launches_only_compile():  # compile each candidate the tuning will time; decide nothing
            for config in configs:
                with contextlib.suppress(Exception):
                    bench(config)
            AHEAD.undecided = (kernel, key)  # for ``choices``
            return configs[0]
        self._notice(name, path)
        timings, failures = [], []
        for config in configs:
            try:
                timings.append((bench(config), config))
            except Exception as err:  # a config that fails to compile or launch is skipped
                failures.append((config, err))
        if not timings:
            config, err = failures[0]
            raise RuntimeError(
                f"no config of {kernel} ran for key {key}; the first, {config.label()}, "
                f"failed with {type(err).__name__}: {err}"
            ) from err
        if failures:  # kept beside the timings: `muon-offload tune` and the cache show them
            failed = {c.label(): f"{type(e).__name__}: {e}"[:300] for c, e in failures}
        ms, best = min(timings, key=lambda t: t[0])
        entry = {"config": asdict(best), "ms": ms, "all_ms": {c.label(): t for t, c in timings}}
        if failures:
            entry["failed"] = failed
        with self._lock:
            self._memory[name] = entry
            self.last[kernel] = {"key": name, **entry}
            self._chosen[fast_key] = best
            if self.retune:
                self.retimed.add(fast_key)
            self._save(path)
        return best

    def choices(self, kernel: str, key: tuple, configs: Sequence[Config], *args) -> tuple:
        """``choose``'s config (same arguments); inside ``compiling_ahead``, for a key left to
        the step, every candidate: the winner's launch there is the caller's variant, not the
        timing's (its sizes and alignment, a fused apply or flag the bench leaves out), so the
        caller launches each in the block and whichever wins finds its binary compiled. Inside
        ``precompile.compile_then_tune``'s first block, none: the key is timed after it and
        the winner alone launched (compiled) in its second."""
        AHEAD.undecided = None
        config = self.choose(kernel, key, configs, *args)
        undecided, AHEAD.undecided = AHEAD.undecided, None
        if undecided != (kernel, key):
            return (config,)
        pending = getattr(AHEAD, "pending", None)
        if pending is not None:  # ``precompile.compile_then_tune``: the winner's, after timing
            pending.append((kernel, key, tuple(configs), *args))
            return ()
        return tuple(configs)


TUNER = Tuner()


def _forced(kernel: str, key: tuple, configs: Sequence[Config], config: Config) -> Config:
    """The config ``tuning.forcing`` gives ``kernel``, when this launch may take it."""
    if config not in configs:
        offered = ", ".join(c.label() for c in configs)
        raise ValueError(
            f"{kernel} cannot take {config.label()} for key {key}; its candidates: {offered}"
        )
    return config


def _cached_config(entry, configs: Sequence[Config]) -> Config | None:
    """The config a cache entry names, when it is one of today's candidates; None for an entry
    that another version of the package wrote (a field this one lacks, a config it no longer
    offers) or that is malformed: the key is then tuned again, never failed on."""
    try:
        config = Config(**entry["config"])
    except (TypeError, KeyError):
        return None
    return config if config in configs else None


# do_bench's warm-up and timing, in ms: a step's tuning (a first step on a GPU the shipped
# tables lack times every candidate of each new key: the step waits) and ``muon-offload tune``'s
# (``retuning``: ahead of training, longer, steadier medians). 8 ms still repeats a kernel of up
# to a millisecond 8 times and the small ones hundreds of times.
STEP_BENCH_MS = (2, 8)
TUNE_BENCH_MS = (5, 20)


def bench_ms(fn: Callable[[], None], reps: int | None = None) -> float:
    """Median time of ``fn`` in milliseconds (CUDA events, after warm-up), timed for ``reps``
    ms, else ``TUNE_BENCH_MS`` when retuning, ``STEP_BENCH_MS`` in a step."""
    import triton.testing

    warmup, rep = TUNE_BENCH_MS if TUNER.retune else STEP_BENCH_MS
    rep = rep if reps is None else reps
    if launches_only_compile():  # the launches only compile: one each, nothing to time
        fn()
        return float("nan")
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


# Scalars of direct launcher calls, by value: a call with the same values reuses its tensor.
_SCALARS: OrderedDict[tuple, Tensor] = OrderedDict()


def device_scalars(values: Sequence[float], device: torch.device) -> Tensor:
    """``values`` as an fp32 tensor on ``device`` (each rounded to nearest, as Triton rounds a
    Python float argument), for a launcher called with Python numbers; cached by value, never
    written. The engine passes its step's scalar table instead (a graph replays that)."""
    key = (tuple(float(v) for v in values), device)
    table = _SCALARS.get(key)
    if table is None:
        if capturing(device):
            raise CaptureMiss("a launcher was given Python scalars under capture")
        table = torch.tensor(key[0], dtype=torch.float32).to(device)
        _SCALARS[key] = table
        if len(_SCALARS) > 256:
            _SCALARS.popitem(last=False)
    return table


def check_scalars(scalars: Tensor, count: int, device: torch.device) -> None:
    """A launcher's scalar tensor: fp32, contiguous, at least ``count`` values, on ``device``."""
    if (
        not isinstance(scalars, Tensor)
        or scalars.dtype != torch.float32
        or scalars.numel() < count
        or not scalars.is_contiguous()
        or scalars.device != device
    ):
        raise ValueError(f"scalars must be a contiguous fp32 tensor of {count} values on {device}")


def scalar_arg(value: float | Tensor, device: torch.device) -> Tensor:
    """A launcher's one runtime scalar, given as a number or already as a device tensor."""
    if isinstance(value, Tensor):
        check_scalars(value, 1, device)
        return value
    return device_scalars((value,), device)


def scratch_like(tensors: Sequence[Tensor], *, positive: bool = False) -> list[Tensor]:
    """Fresh random tensors with the sizes, shapes and dtypes of ``tensors`` (never zeros)."""
    out = []
    for t in tensors:
        s = torch.randn(t.shape, dtype=torch.float32, device=t.device)
        if positive:
            s = s.abs_().add_(1e-3)
        out.append(s.to(t.dtype))
    return out
