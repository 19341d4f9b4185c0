"""Host (Python) time of ``step()`` on the CPU: wall time per step, and where it goes.

    python bench/host_time.py [--steps 50] [--layers 48] [--scale 64] [--only demo|qwen3]
                              [--kernels torch|stub|both|replay] [--json out.json]

On a GPU a step's kernels run asynchronously, so what the host spends issuing them is the
step's Python: checking groups, planning, building each unit's job, and one torch call per
launch. This script measures that work on the CPU with ``backend="torch"``, on tensors small
enough that the torch calls themselves are cheap:

- ``demo``: the demo's TinyGPT (``muon_offload.tools.demo_model``), resident and offloaded (the
  demo's 256 KiB chunks, and the default chunk size);
- ``qwen3``: ``qwen3-30b-a3b-ep8-rank`` with every dimension divided by ``--scale`` and the
  chunk budgets divided by its square, so the tensor, unit and chunk counts are the real
  workload's while the arithmetic is tiny.

Each case runs twice: with the torch references of the kernels (``torch``: the real CPU
step, whose torch calls do the arithmetic) and with the launchers (``optim/muon_launch.py``,
``optim/elementwise.py``) stubbed out (``stub``: each returns an output of the right shape and
computes nothing), which leaves the engine's own host time: checks, state, plans, jobs,
views. On a GPU the kernels' launches come on top of the stubbed figure.

``--kernels replay`` times what a replayed step (``cuda_graph=True``) still runs on the host:
the Triton path's step (``backend="triton"``, kernels stubbed) with a stand-in graph that
captures and replays nothing, so a timed step is the checks, the state and plan lookups, the
scalar table's fill and the graph's key, without the launches the replay saves.

For each case it prints the median wall time of a step (no profiler), the aten ops a step
issues (each one a kernel launch or a view on a GPU), and a cProfile breakdown by phase,
scaled to the unprofiled wall time, with the time spent inside torch calls apart from the
Python around them. Host-only figures: nothing here is a GPU measurement.

``--gpu`` (on a GPU) times the real step instead, eager and with
``cuda_graph=True``, on the demo model and the full-size qwen3 workload (``--scale`` 1 unless
given), resident and offloaded: the host time to issue a step (``step()`` returning), the
step's GPU time (CUDA events around it, the GPU held by a sleep kernel while the host issues,
so that no host gap counts), their ratio, the synchronized step time, and the graph's
captures, replays and memory pool:

    python bench/host_time.py --gpu [--only demo|qwen3] [--layers 48] [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import platform
import pstats
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from muon_offload import Muon
from muon_offload.engine import settings
from muon_offload.tools import demo_model as demo
from muon_offload.tools.bench.modes import build
from muon_offload.tools.workloads import ParamSpec, qwen3_30b_a3b_ep8_rank

from host_time_stubs import replayed, stubbed_kernels

# Phases, as the functions that run them (module file suffix, function name). A function
# that is not found (renamed) simply reads 0. "run" includes "jobs" and "update".
PHASES = (
    ("check groups and grads", "engine/optimizer.py", "_check_step"),
    ("rank agreement", "distributed/rank_agreement.py", "check"),
    ("state lookup/creation", "engine/state.py", "ensure"),
    ("plan (lookup or build)", "engine/step_plans.py", "plan"),
    ("scheduler run (all chunks)", "engine/scheduler.py", "run"),
    ("  unit jobs (views, lists)", "engine/chunks.py", "_job"),
    ("  chunk state lists", "engine/chunks.py", "chunk_state"),
    ("  muon update", "muon_offload/optim/muon.py", "update"),
    ("  element-wise update", "muon_offload/optim/elementwise.py", "update"),
    ("    orthogonalize", "muon_offload/optim/muon_launch.py", "orthogonalize_batch"),
    ("scalar table fill", "engine/scalars.py", "write"),
    ("graph key", "engine/graphs.py", "step_key"),
)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _torch_builtin(key) -> bool:
    """A cProfile entry for a C function of torch (an op, a tensor method, a view)."""
    filename, _, name = key
    return filename == "~" and "torch" in name


def measure(name: str, opt, steps: int) -> dict:
    for _ in range(3):  # state creation, the plan, first-call caches
        opt.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    wall = statistics.median(times)

    with OpCounter() as counter:
        opt.step()
    ops = sum(counter.ops.values())

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        opt.step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    step_key = next(k for k in stats if k[2] == "step" and k[0].endswith("engine/optimizer.py"))
    profiled = stats[step_key][3] / steps  # cumulative time of step(), per step
    scale = wall / profiled

    phases = []
    for label, suffix, func in PHASES:
        ct = sum(v[3] for k, v in stats.items() if k[2] == func and k[0].endswith(suffix))
        phases.append((label, ct / steps * scale))
    torch_tt = sum(v[2] for k, v in stats.items() if _torch_builtin(k)) / steps * scale
    calls = sum(v[1] for v in stats.values()) / steps
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:15]
    return {
        "case": name,
        "wall_ms": wall * 1e3,
        "min_ms": min(times) * 1e3,
        "p10_ms": sorted(times)[len(times) // 10] * 1e3,
        "p90_ms": sorted(times)[len(times) * 9 // 10] * 1e3,
        "aten_ops": ops,
        "python_calls": calls,
        "torch_ms": torch_tt * 1e3,
        "python_ms": (wall - torch_tt) * 1e3,
        "phases_ms": {label: t * 1e3 for label, t in phases},
        "top": [
            {
                "function": f"{k[0].rsplit('/', 2)[-1]}:{k[1]}({k[2]})",
                "calls": v[1] / steps,
                "ms": v[2] / steps * scale * 1e3,
            }
            for k, v in top
        ],
    }


def report(r: dict) -> None:
    print(
        f"\n== {r['case']}: {r['wall_ms']:.3f} ms/step (min {r['min_ms']:.3f}, "
        f"p10 {r['p10_ms']:.3f}, "
        f"p90 {r['p90_ms']:.3f}); inside torch calls {r['torch_ms']:.3f} ms, Python around "
        f"them {r['python_ms']:.3f} ms; {r['aten_ops']} aten ops, "
        f"{r['python_calls']:.0f} profiled calls a step"
    )
    for label, ms in r["phases_ms"].items():
        print(f"  {label:<30} {ms:8.3f} ms")
    print("  top functions by own time (ms/step, calls/step):")
    for t in r["top"][:10]:
        print(f"    {t['ms']:7.3f} {t['calls']:8.0f}  {t['function'][:90]}")


def _demo_model(device):
    """The demo's TinyGPT with one step's gradients, and its parameter count."""
    torch.manual_seed(0)
    vocab, dim, layers, heads, seq, batch = 64, 64, 2, 4, 32, 16
    model = demo.TinyGPT(vocab, dim, layers, heads, seq).to(device)
    tokens = next(demo.markov_batches(vocab, seq, batch, seed=1)).to(device)
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)
    ).backward()
    return model, sum(p.numel() for p in model.parameters())


def _qwen3_specs(layers: int, scale: int) -> list[ParamSpec]:
    return [
        ParamSpec(s.name, tuple(max(1, d // scale) for d in s.shape), s.algorithm)
        for s in qwen3_30b_a3b_ep8_rank(layers)
    ]


def demo_cases():
    """(name, make optimizer(backend)) on the CPU."""
    model, n = _demo_model("cpu")
    for name, kw in (
        (f"demo ({n:,} params) resident", {}),
        ("demo offload, 256 KiB chunks", dict(offload=True, chunk_bytes=256 << 10)),
        ("demo offload, default chunks", dict(offload=True)),
    ):
        yield (
            name,
            lambda backend, kw=kw: Muon(demo.param_groups(model), lr=0.02, backend=backend, **kw),
        )


def qwen3_cases(layers: int, scale: int):
    """(name, make optimizer(backend)) on the CPU."""
    specs = _qwen3_specs(layers, scale)
    groups, _, _ = build(specs, torch.device("cpu"))
    budget = scale * scale
    chunk = settings.DEFAULT_CHUNK_BYTES // budget
    resident_chunk = settings.DEFAULT_RESIDENT_CHUNK_BYTES // budget
    what = f"qwen3 {layers} layers / {scale} ({len(specs)} tensors)"
    for name, kw in (("resident", {}), ("offload", dict(offload=True, chunk_bytes=chunk))):
        yield (
            f"{what} {name}",
            lambda backend, kw=kw: Muon(
                groups, lr=0.01, resident_chunk_bytes=resident_chunk, backend=backend, **kw
            ),
        )


def gpu_cases(only: str | None, layers: int, scale: int):
    """(name, make optimizer(cuda_graph)) on the GPU, gradients in place."""
    device = torch.device("cuda")
    if only in (None, "demo"):
        model, _ = _demo_model(device)
        for name, kw in (("resident", {}), ("offload 256 KiB", dict(chunk_bytes=256 << 10))):
            offload = bool(kw)
            yield (
                f"demo {name}",
                lambda g, kw=kw, offload=offload: Muon(
                    demo.param_groups(model), lr=0.02, offload=offload, cuda_graph=g, **kw
                ),
            )
    if only in (None, "qwen3"):
        groups, _, _ = build(_qwen3_specs(layers, scale), device)
        what = f"qwen3 {layers} layers" + (f" / {scale}" if scale > 1 else "")
        for name, offload in (("resident", False), ("offload", True)):
            yield (
                f"{what} {name}",
                lambda g, o=offload: Muon(groups, lr=0.01, offload=o, cuda_graph=g),
            )


def measure_gpu(name: str, make, steps: int) -> dict:
    opt = make(name.endswith("graph"))
    for _ in range(4):  # state, tuning; with cuda_graph: eager, capture, replays
        opt.step()
    host, total = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        total.append(time.perf_counter() - start)
    gpu = []
    hold = max(host) * 2 + 1e-3  # the GPU sleeps while the host issues the whole step
    for _ in range(steps):
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(hold * 2e9))  # cycles at ~2 GHz
        begin.record()
        opt.step()
        end.record()
        end.synchronize()
        gpu.append(begin.elapsed_time(end) / 1e3)
    row = {
        "case": name,
        "host_ms": statistics.median(host) * 1e3,
        "gpu_ms": statistics.median(gpu) * 1e3,
        "step_ms": statistics.median(total) * 1e3,
        "step_min_ms": min(total) * 1e3,
        "graph": opt.graph_stats(),
    }
    row["host_over_gpu"] = row["host_ms"] / row["gpu_ms"]
    del opt
    torch.cuda.empty_cache()
    return row


def main_gpu(args) -> list[dict]:
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':<36} {'host ms':>9} {'GPU ms':>9} {'host/GPU':>9} {'step ms':>9}  graph")
    for name, make in gpu_cases(args.only, args.layers, args.scale or 1):
        for mode in ("eager", "graph"):
            r = measure_gpu(f"{name} {mode}", make, args.steps)
            g = r["graph"] or {}
            graph = (
                f"{g['captures']} captures, {g['replays']} replays, pool "
                f"{g['pool_bytes'] / 2**20:.0f} MiB{', off: ' + g['off'] if g['off'] else ''}"
                if g
                else ""
            )
            print(
                f"{r['case']:<36} {r['host_ms']:9.3f} {r['gpu_ms']:9.3f} "
                f"{r['host_over_gpu']:9.3f} {r['step_ms']:9.3f}  {graph}",
                flush=True,
            )
            rows.append(r)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--scale", type=int, default=None, help="divide every dimension by this")
    ap.add_argument("--gpu", action="store_true", help="time the real step on a GPU (above)")
    ap.add_argument("--only", choices=("demo", "qwen3"), default=None)
    ap.add_argument("--kernels", choices=("torch", "stub", "both", "replay"), default="both")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.gpu:
        results = main_gpu(args)
        if args.json:
            meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)
        return 0
    torch.set_num_threads(1)  # host time, not CPU kernel parallelism
    cases = []
    if args.only in (None, "demo"):
        cases += list(demo_cases())
    if args.only in (None, "qwen3"):
        cases += list(qwen3_cases(args.layers, args.scale or 64))
    results = []
    modes = ("stub", "torch") if args.kernels == "both" else (args.kernels,)
    for mode in modes:
        for name, make in cases:
            if mode == "replay":  # the Triton path's scalar table, no launches
                opt = make("triton")
                context = replayed(opt)
            else:
                opt = make("torch")
                context = stubbed_kernels() if mode == "stub" else contextlib.nullcontext()
            with context:
                r = measure(f"{name} [{mode}]", opt, args.steps)
            r["kernels"] = mode
            report(r)
            results.append(r)
    if args.json:
        meta = {"python": platform.python_version(), "torch": torch.__version__}
        meta["cpu"] = platform.processor() or platform.machine()
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
