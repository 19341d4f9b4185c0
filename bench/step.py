"""Optimizer-step benchmark on a named workload: resident and offloaded muon-offload, the
all-at-once offload baseline and dion's resident Muon, against the PCIe transfer floor.

    python bench/step.py --out step.json [--layers 48] [--memory-layers 12 24] [--dion-path .dion]

Measured first in the same run: pinned host<->device bandwidth each way alone and both at
once, and the device-memory copy bandwidth. The transfer floor of an offloaded mode is its
state bytes over the both-directions bandwidth (each direction moves the state once).
For each mode: median, min and max step time over the timed steps (after warm-up, which
includes state creation, pinning and kernel tuning), and the peak GPU memory the step adds
above weights and gradients. One offloaded step's per-chunk timeline (CUDA events) is kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

GIB = 1 << 30
MIB = 1 << 20


def _sync():
    torch.cuda.synchronize()


def bandwidths(nbytes: int = GIB, reps: int = 5) -> dict:
    """GB/s (1e9 bytes/s): h2d alone, d2h alone, each direction when both run at once, and
    the device copy (bytes read + written)."""
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn):
        times = []
        for _ in range(reps + 1):
            _sync()
            t = time.perf_counter()
            fn()
            _sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    def both():
        with torch.cuda.stream(s1):
            dev_b.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_a, non_blocking=True)

    out = {
        "h2d_alone": nbytes / timed(lambda: dev_b.copy_(host_a, non_blocking=True)) / 1e9,
        "d2h_alone": nbytes / timed(lambda: host_b.copy_(dev_a, non_blocking=True)) / 1e9,
        "both_each": nbytes / timed(both) / 1e9,
        "device_copy": 2 * nbytes / timed(lambda: dev_b.copy_(dev_a)) / 1e9,
    }
    return out


def build(layers: int, seed: int = 0):
    from muon_offload.workloads import materialize, qwen3_30b_a3b_ep8_rank

    specs = qwen3_30b_a3b_ep8_rank(layers)
    params = materialize(specs, "cuda", seed=seed)
    muon = [p for p, s in zip(params, specs, strict=True) if s.algorithm == "muon"]
    adamw = [p for p, s in zip(params, specs, strict=True) if s.algorithm != "muon"]
    groups = [dict(params=muon), dict(params=adamw, algorithm="adamw", lr=1e-3)]
    weights_and_grads = sum(2 * p.numel() * p.element_size() for p in params)
    return groups, params, weights_and_grads


def state_bytes_of(params, groups, itemsize: int) -> int:
    muon = sum(p.numel() for p in groups[0]["params"])
    adamw = sum(p.numel() for p in groups[1]["params"])
    return (muon + 2 * adamw) * itemsize


def time_steps(opt, warmup: int, steps: int, base: int) -> dict:
    for _ in range(warmup):
        opt.step()
    _sync()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        _sync()
        t = time.perf_counter()
        opt.step()
        _sync()
        times.append(time.perf_counter() - t)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "steps": steps,
        "peak_added_gib": (torch.cuda.max_memory_allocated() - base) / GIB,
    }


def timeline(opt) -> list[dict]:
    sched = opt._scheduler
    sched.timeline = []
    _sync()
    opt.step()
    _sync()
    marks, sched.timeline = sched.timeline, None
    ref = marks[0][2]  # the first event recorded; times may be negative relative to it
    rows = [
        {"chunk": c, "stage": stage, "start_ms": ref.elapsed_time(s), "end_ms": ref.elapsed_time(e)}
        for c, stage, s, e in marks
    ]
    t0 = min(r["start_ms"] for r in rows)
    for r in rows:
        r["start_ms"] -= t0
        r["end_ms"] -= t0
    return rows


def run_ours(args, bw) -> dict:
    from muon_offload import Muon

    results = {}
    groups, params, base = build(args.layers)
    floor = {}
    for dtype, itemsize in (("fp32", 4), ("bf16", 2)):
        nbytes = state_bytes_of(params, groups, itemsize)
        floor[dtype] = {"state_gib": nbytes / GIB, "floor_s": nbytes / (bw["both_each"] * 1e9)}
    results["floor"] = floor

    def mode(name, **kwargs):
        print(f"  {name} ...", flush=True)
        opt = Muon(groups, lr=0.01, **kwargs)
        r = time_steps(opt, args.warmup, args.steps, base)
        results[name] = r
        return opt

    opt = mode("ours_resident")
    del opt
    torch.cuda.empty_cache()

    def sweep(opt, key):
        results[key] = {}
        for mib in args.chunk_mib:  # same host state, other chunk sizes: a fresh ring each
            opt.chunk_bytes, opt._scheduler = mib * MIB, None
            opt._plans.clear()
            torch.cuda.empty_cache()
            results[key][mib] = time_steps(opt, 1, args.steps, base)

    opt = mode("ours_offload_fp32", offload=True)
    results["timeline_fp32"] = timeline(opt)
    sweep(opt, "chunk_sweep")
    opt.chunk_bytes, opt._scheduler = 1 << 50, None  # everything in one chunk
    opt._plans.clear()
    torch.cuda.empty_cache()
    print("  all_at_once ...", flush=True)
    results["all_at_once"] = time_steps(opt, 1, args.steps, base)
    del opt
    torch.cuda.empty_cache()
    opt = mode("ours_offload_bf16", offload=True, state_dtype=torch.bfloat16)
    results["timeline_bf16"] = timeline(opt)
    sweep(opt, "chunk_sweep_bf16")
    return results


def run_memory(args) -> dict:
    from muon_offload import Muon

    out = {}
    for layers in args.memory_layers:
        groups, params, base = build(layers)
        opt = Muon(groups, lr=0.01, offload=True)
        out[layers] = time_steps(opt, 2, 3, base)
        out[layers]["state_gib"] = state_bytes_of(params, groups, 4) / GIB
        del opt, groups, params
        torch.cuda.empty_cache()
    return out


def run_dion(args) -> dict:
    """dion's Muon, eager (torch.compile off, as ANCHORS.md measured it), in a subprocess."""
    env = dict(
        os.environ,
        TORCHDYNAMO_DISABLE="1",
        PYTHONPATH=os.pathsep.join([args.dion_path, os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        __file__,
        "--dion-worker",
        "--layers",
        str(args.layers),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def dion_worker(args) -> None:
    import dion

    groups, params, base = build(args.layers)
    opt = dion.Muon(groups, lr=0.01)
    r = time_steps(opt, args.warmup, args.steps, base)
    r["commit"] = os.environ.get("DION_COMMIT", "0a059a4")

    # ANCHORS.md's all-at-once baseline: every state tensor copied from persistent pinned host
    # buffers to the GPU, dion's step, and back.
    state = [t for s in opt.state.values() for k, t in s.items() if k in ("momentum", "variance")]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in state]

    class AllAtOnce:
        @staticmethod
        def step():
            for t, h in zip(state, host, strict=True):
                t.copy_(h, non_blocking=True)
            opt.step()
            for t, h in zip(state, host, strict=True):
                h.copy_(t, non_blocking=True)

    r["all_at_once"] = time_steps(AllAtOnce, 1, args.steps, base)
    print(json.dumps(r))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON file for the results (required)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--memory-layers", type=int, nargs="*", default=[12, 24])
    ap.add_argument("--chunk-mib", type=int, nargs="*", default=[32, 64, 128, 512])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--dion-path", default=None)
    ap.add_argument("--dion-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dion_worker:
        dion_worker(args)
        return 0
    if not args.out:
        ap.error("--out is required")
    import triton

    info = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": vars(args),
    }
    print("bandwidths ...", flush=True)
    bw = bandwidths()
    results = {"info": info, "bandwidth_gbps": bw}
    torch.cuda.empty_cache()
    print(f"ours, {args.layers} layers ...", flush=True)
    results.update(run_ours(args, bw))
    torch.cuda.empty_cache()
    print("memory at other sizes ...", flush=True)
    results["memory_by_layers"] = run_memory(args)
    if args.dion_path:
        print("dion ...", flush=True)
        results["dion_resident"] = run_dion(args)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    report(results)
    return 0


def report(r: dict) -> None:
    bw, floor = r["bandwidth_gbps"], r["floor"]
    i = r["info"]
    print(f"\n{i['card']} | torch {i['torch']} | triton {i['triton']} | {i['date']}")
    print(
        f"bandwidth GB/s: h2d {bw['h2d_alone']:.1f}, d2h {bw['d2h_alone']:.1f}, both at once "
        f"{bw['both_each']:.1f} each, device copy {bw['device_copy']:.0f}"
    )
    f32, b16 = floor["fp32"], floor["bf16"]
    print(
        f"transfer floor: fp32 state {f32['state_gib']:.2f} GiB -> {f32['floor_s']:.3f} s; "
        f"bf16 {b16['state_gib']:.2f} GiB -> {b16['floor_s']:.3f} s"
    )
    dion = r.get("dion_resident", {})
    rows = [
        ("ours resident", r["ours_resident"], None),
        ("ours offload fp32", r["ours_offload_fp32"], floor["fp32"]["floor_s"]),
        ("ours offload bf16", r["ours_offload_bf16"], floor["bf16"]["floor_s"]),
        ("all-at-once offload", r["all_at_once"], floor["fp32"]["floor_s"]),
    ]
    if "median_s" in dion:
        rows.append(("dion resident (eager)", dion, None))
        rows.append(("dion all-at-once offload", dion["all_at_once"], floor["fp32"]["floor_s"]))
    print(f"{'mode':<24}{'median s':>10}{'min':>8}{'max':>8}{'+GiB':>8}{'/floor':>8}{'/dion':>8}")
    for name, m, fl in rows:
        to_floor = f"{m['median_s'] / fl:.2f}" if fl else "-"
        to_dion = f"{m['median_s'] / dion['median_s']:.2f}" if "median_s" in dion else "-"
        print(
            f"{name:<24}{m['median_s']:>10.3f}{m['min_s']:>8.3f}{m['max_s']:>8.3f}"
            f"{m['peak_added_gib']:>8.2f}{to_floor:>8}{to_dion:>8}"
        )
    if "error" in dion:
        print("dion failed:", dion["error"][-500:])
    print(
        "chunk sweep (offload fp32):",
        {k: round(v["median_s"], 3) for k, v in r["chunk_sweep"].items()},
    )
    print(
        "memory by layers (offload fp32, +GiB above weights and grads):",
        {k: round(v["peak_added_gib"], 2) for k, v in r["memory_by_layers"].items()},
    )


if __name__ == "__main__":
    sys.exit(main())
