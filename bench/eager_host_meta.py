"""The host side of an eager ``step()`` (``cuda_graph=False``) of bench/training_loop.py's
full-size models, without a GPU: the models on meta tensors, ``backend="triton"``, inside
``kernels.tuning.recording_keys`` (every Triton launch taken to its launcher's call and
skipped, the CUDA paths taken), as bench/tuning_keys.py runs a first step.

    python bench/eager_host_meta.py --models moe dense [--steps 5] [--profile]

For each model and mode (resident, offloaded int8 and fp32: training_loop.py's ``OURS``, the
offloaded ones as ``tuning_keys.as_streamed``: their chunks and launches at the chunk size an
eager step gets by default, 1 GiB for 8-bit state, without the host copies) it prints the
median and fastest wall milliseconds of a steady step (after four: the last two with the
configs the H200's shipped table gives, so the products take the TMA kernels and their
descriptors where a card would), the Triton launches and the aten ops a step issues (each a
kernel launch, a copy or a view on a GPU), the Python share of the time (outside torch's own
calls) and the share under the launchers of ``kernels/`` and Triton. An estimate of the step's
host time on a GPU adds a cost per launch to the fastest step's Python: ``--launch-us`` per
Triton launch, ``--op-us`` per aten op (meta ops cost what their shape functions do, not a CUDA
launch, so they are not timed here). Host figures of this machine: nothing here is a GPU
measurement; training_loop.py's ``*_eager`` modes measure it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
from host_time import OpCounter
from muon_offload.kernels import tuning
from muon_offload.kernels.config import Config
from training_loop import MODELS, OPTIONAL, OURS, config
from transformers_step import MUON_LR, bench_groups, build_model
from tuning_keys import TABLE, as_streamed

from muon_offload import Muon


@contextlib.contextmanager
def counted_launches():
    """Within ``recording_keys``: a Counter of the Triton kernels launched (by name)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: Counter = Counter()
    saved = [(c, c.run) for c in (JITFunction, InterpretedFunction)]

    def run(self, *args, grid, warmup, **kwargs):
        launches[getattr(self, "__name__", None) or self.fn.__name__] += 1
        return None

    for cls, _ in saved:
        cls.run = run
    try:
        yield launches
    finally:
        for cls, original in saved:
            cls.run = original


def shipped_choices(table: str):
    """A tuner's ``choose`` that takes each key's config from the shipped ``table``
    (``kernels/tuned/``) as a GPU whose cache lacks it does (the first candidate where the
    table decides nothing), then from a dictionary, as the tuner's choices of the process."""
    entries = json.loads((Path(tuning.__file__).parent / "tuned" / table).read_text())
    chosen: dict = {}

    def choose(kernel, key, configs, *args, **kwargs):
        config = chosen.get((kernel, key))
        if config is None:
            name = f"{kernel}|" + "|".join(str(k) for k in key)
            _, source = tuning.shipped_decision(table, name, configs)
            config = Config(**entries[source]["config"]) if source else configs[0]
            chosen[kernel, key] = config
        return config

    return choose


def _builtin(key) -> bool:
    return key[0] == "~"


def _kernels_file(key) -> bool:
    return "/kernels/" in key[0] or "/triton/" in key[0]


def _in_kernels(stats: dict) -> float:
    """Seconds spent in the launchers of ``kernels/`` and in Triton (all they call included):
    the cumulative time of each of their functions as the package's engine and algorithms
    call it."""
    return sum(
        timing[3]
        for key, (_, _, _, _, callers) in stats.items()
        if _kernels_file(key)
        for caller, timing in callers.items()
        if "/muon_offload/" in caller[0]
    )


def measure(model, settings: dict, steps: int, profile: bool, table: str = TABLE) -> dict:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    settings = dict(settings, cuda_graph=False)
    opt = Muon(bench_groups(model), lr=MUON_LR, backend="triton", **settings)
    with tuning.recording_keys(), counted_launches() as launches:
        for _ in range(2):  # first-step work: plans, tables, caches
            opt.step()
        tuning.TUNER.choose = shipped_choices(table)
        for _ in range(2):  # the configs the card's table gives (TMA products: descriptors)
            opt.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        launches.clear()
        with OpCounter() as counter:
            opt.step()
        row = {
            "wall_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3,
            "triton_launches": sum(launches.values()),
            "launches_by_kernel": dict(launches.most_common()),
            "aten_ops": sum(counter.ops.values()),
            "ops_by_name": dict(counter.ops.most_common(12)),
        }
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            opt.step()
        prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(v[2] for v in stats.values()) / steps
    builtin = sum(v[2] for k, v in stats.items() if _builtin(k)) / steps
    row["python_share"] = (total - builtin) / total if total else 0.0
    row["kernels_share"] = _in_kernels(stats) / steps / total if total else 0.0
    row["python_calls"] = sum(v[1] for v in stats.values()) / steps
    if profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return row


def run(kind: str, mode: str, layers: int | None, steps: int, profile: bool = False) -> dict:
    """``measure`` of training_loop.py's ``kind`` model (``layers`` of it; None: all) on meta
    tensors, with the settings of ``mode`` (``OURS``)."""
    cfg = config(kind, SimpleNamespace(tiny=False, layers=layers, seq=1024))
    model = build_model(cfg, 0, torch.device("meta"), torch.float32)
    return measure(model, as_streamed(dict(OURS[mode], cuda_graph=False)), steps, profile)


def estimate(row: dict, launch_us: float, op_us: float) -> float:
    """Host ms on a GPU: this machine's Python around the calls (its fastest step: the host
    is shared), plus a cost per launch."""
    python = row["min_ms"] * row["python_share"]
    return python + (row["triton_launches"] * launch_us + row["aten_ops"] * op_us) / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("eager_host_meta.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument(
        "--modes", nargs="+", choices=list(OURS), default=[m for m in OURS if m not in OPTIONAL]
    )
    ap.add_argument("--layers", type=int, default=None, help="default: the model's")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--launch-us", type=float, default=20.0, help="host us a Triton launch")
    ap.add_argument("--op-us", type=float, default=5.0, help="host us an aten op")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for kind in args.models:
        for mode in args.modes:
            row = run(kind, mode, args.layers, args.steps, args.profile)
            print(
                f"{kind} {mode}: {row['wall_ms']:.2f} ms/step here (min {row['min_ms']:.2f}; "
                f"{row['python_share']:.0%} "
                f"Python, {row['python_calls']:.0f} calls; {row['kernels_share']:.0%} in "
                f"kernels/ and Triton), {row['triton_launches']} Triton "
                f"launches, {row['aten_ops']} aten ops; estimate "
                f"{estimate(row, args.launch_us, args.op_us):.1f} ms on a GPU host",
                flush=True,
            )
            print(f"  launches: {row['launches_by_kernel']}")
            print(f"  ops: {row['ops_by_name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
