"""The kernels' tuning, as the tools see it: force re-timing, read what the last tuning of a
kernel chose, where the choices are cached, and which keys a step needs and whether a shipped
table decides them. The tuner itself lives in ``_launch.py``."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ._launch import TUNER, Config, Tuner, _cached_config


@contextlib.contextmanager
def retuning(enabled: bool = True) -> Iterator[None]:
    """Within the block, every kernel launch re-times its configs even where the cache holds
    a choice (the new winners replace the cached ones), each key once."""
    before = TUNER.retune
    TUNER.retune = enabled
    TUNER.retimed = set()  # each key timed once in the block
    try:
        yield
    finally:
        TUNER.retune = before


@contextlib.contextmanager
def forcing(kernel: str, config: Config) -> Iterator[None]:
    """Within the block, every CUDA launch of ``kernel`` (``"sym_gram"``, ``"poly_apply"``,
    ``"muon_prep"``, ...) takes ``config``: nothing timed, cached or read from a table (a
    benchmark of each candidate, a bisection). A launch whose candidates lack it raises
    ValueError, naming them. Not for use beside a step on another thread."""
    before = TUNER.forced
    TUNER.forced = {**before, kernel: config}
    try:
        yield
    finally:
        TUNER.forced = before


def last_choice(kernel: str) -> tuple[str, float] | None:
    """(config label, its time in ms) that the last tuning or cache hit of ``kernel`` gave in
    this process, or None."""
    last = TUNER.last.get(kernel)
    if not last or "config" not in last:
        return None
    return Config(**last["config"]).label(), float(last.get("ms", float("nan")))


def cache_path(device: torch.device) -> Path:
    """The JSON file holding this GPU's and this Triton's tuning choices."""
    return Tuner.cache_path(device)


@contextlib.contextmanager
def recording_keys(tma: bool = True) -> Iterator[dict[str, tuple[Config, ...]]]:
    """Within the block, every tuned launch records its key (the cache's name,
    ``kernel|field|...``) with its candidates in the dict yielded, and runs nothing: no
    timing, no Triton kernel launched, each launcher takes its first candidate. The paths
    that CUDA tensors take are taken (the orthogonalization's products and the kernels of
    the norms, which CPU tensors keep on torch), so a step run on the CPU, on tensors of the
    meta device even, with ``backend="triton"``, lists the keys that its first step on a GPU
    decides. ``tma``: as on a GPU with TMA (compute capability 9.0 and up: the products'
    keys hold the flag). One thread at a time."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from . import orthogonalize as ortho
    from . import poly_apply

    keys: dict[str, tuple[Config, ...]] = {}

    def choose(kernel, key, configs, interpreter_config, device, bench, force=False):
        keys[f"{kernel}|" + "|".join(str(k) for k in key)] = tuple(configs)
        return configs[0]

    def run(self, *args, grid, warmup, **kwargs):  # nothing launched
        return None

    inner = ortho._orthogonalize

    def as_on_cuda(update, sumsq, method, eps, products, apply_to):
        if products == "auto" and update.ndim == 3:  # CUDA's resolution of "auto"
            tall = update.size(-2) > update.size(-1)
            products = ortho.products_for(update.mT if tall else update)
        return inner(update, sumsq, method, eps, products, apply_to)

    span = poly_apply._span

    def no_span(t):  # meta tensors all start at address 0: no overlap to refuse
        return (0, 0) if t.is_meta else span(t)

    saved = [(c, c.run) for c in (JITFunction, InterpretedFunction)]
    env = {k: os.environ.get(k) for k in ("MUON_OFFLOAD_TMA", "TRITON_INTERPRET")}
    os.environ["MUON_OFFLOAD_TMA"] = "1" if tma else "0"
    os.environ["TRITON_INTERPRET"] = "1"  # the norms' kernels for tensors off CUDA
    TUNER.choose = choose  # the instance's: ``choices`` reads it too
    ortho._orthogonalize = as_on_cuda
    poly_apply._span = no_span
    for cls, _ in saved:
        cls.run = run
    try:
        yield keys
    finally:
        del TUNER.choose
        ortho._orthogonalize = inner
        poly_apply._span = span
        for cls, original in saved:
            cls.run = original
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def shipped_decision(
    file_name: str, name: str, configs: Sequence[Config]
) -> tuple[str, str | None]:
    """How the shipped table ``file_name`` (``tuned/``) decides key ``name`` among
    ``configs``, as the tuner asks it where the user's cache lacks the key: ("exact", name),
    ("nearest", the class it takes), or ("timed", None): no entry of the kernel and other
    fields, so a first step times the candidates on the card."""
    table = TUNER._shipped
    pick = functools.partial(_cached_config, configs=configs)
    found = table.choice(file_name, name, pick)
    if found is None:
        return "timed", None
    entry = table._table(file_name).get(name)
    if entry is not None and pick(entry) is not None:
        return "exact", name
    nearest = next(k for k, e in table._table(file_name).items() if e is found[0])
    return "nearest", nearest
