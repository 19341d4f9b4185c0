"""The host<->device copies of the training loop users write (bench/training_loop.py), for one
mode: a profiler pass over a few iterations after warm-up, and from its trace, per CUDA stream,
the bytes each way and the time busy copying; per step (the device work ``step()`` queued,
graph replays included), its span, the busy time of each copy direction and of kernels, and
the stalls of the loads: gaps longer than ``--gap-ms`` between one host-to-device copy's end
and the next's start, each with the device-to-host copies that ended shortly before the next
began (the stores whose bytes that load waited for, most likely).

    python bench/loop_copies.py --mode ours_offload_fp32 --json copies.json --trace t.json.gz

A step whose loads stall behind stores shows it here in one call: which stores, how long, how
often (docs/benchmarks.md, "One store stream"). ``--trace`` keeps the device's events for a
closer look.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # as training_loop.py: dion eager

import argparse  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402
from training_loop import MODES, build, config  # noqa: E402
from training_loop import parse as loop_parse  # noqa: E402
from training_loop_report import environment  # noqa: E402
from transformers_step import Meter  # noqa: E402

DIRECTIONS = ("HtoD", "DtoH", "DtoD")


def direction(name: str) -> str | None:
    """The direction a profiler memcpy's name gives ("Memcpy HtoD (Pinned -> Device)")."""
    return next((d for d in DIRECTIONS if d in name), None)


STEP = "Optimizer.step#"  # torch.optim.Optimizer's profiler range around each step()
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME = ("cuda_runtime", "cuda_driver")


def _ms(e: dict) -> tuple[float, float]:
    start = float(e["ts"]) / 1e3
    return start, start + float(e.get("dur", 0.0)) / 1e3


def _busy_ms(spans: list[tuple[float, float]]) -> float:
    """The time covered by the union of ``spans``."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def summarize(events: list[dict], gap_ms: float = 1.0, before_ms: float = 0.5) -> dict:
    """From chrome-trace events: per stream, the bytes and busy ms of its copies each way; and
    per step, the device work queued inside an ``Optimizer.step#`` range (by the correlation
    ids of the runtime calls made in it: a replayed graph's nodes run on streams of the graph's
    own, so a stream does not say whose work it ran): its span, the bytes and busy ms each
    way and of kernels (union over streams: each way has one copy engine), and the loads'
    stalls, gaps over ``gap_ms`` between one host-to-device copy's end and the next's start
    (on any stream), each with the device-to-host copies that ended within ``before_ms``
    before the load resumed (the stores whose bytes it waited for, most likely)."""
    copies = []
    for e in events:
        kind = direction(e.get("name", "")) if e.get("cat") == "gpu_memcpy" else None
        if kind is not None:
            args = e.get("args", {})
            copies.append((*_ms(e), kind, args.get("stream"), int(args.get("bytes", 0))))
    copies.sort()
    streams: dict = defaultdict(lambda: {d: {"bytes": 0, "busy_ms": 0.0} for d in DIRECTIONS})
    for start, end, kind, stream, nbytes in copies:
        streams[stream][kind]["bytes"] += nbytes
        streams[stream][kind]["busy_ms"] += end - start
    t0 = copies[0][0] if copies else 0.0
    stores = [c for c in copies if c[2] == "DtoH"]
    steps = [_step(work, stores, gap_ms, before_ms) for work in _steps_work(events)]
    return {
        "copies": len(copies),
        "window_ms": round(max(c[1] for c in copies) - t0, 3) if copies else 0.0,
        "streams": {str(s): v for s, v in streams.items()},
        "steps": steps,
        "load_stall_ms": round(sum(st["load_stall_ms"] for st in steps), 3),
    }


def _steps_work(events: list[dict]) -> list[list[dict]]:
    """Each step's device events: those whose runtime call ran inside its profiler range."""
    ranges = sorted(
        _ms(e)
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith(STEP)
    )
    step_of = {}
    for e in events:
        if e.get("cat") in RUNTIME:
            at = _ms(e)[0]
            k = next((k for k, (a, b) in enumerate(ranges) if a <= at <= b), None)
            if k is not None:
                step_of[e.get("args", {}).get("correlation")] = k
    work: list[list[dict]] = [[] for _ in ranges]
    for e in events:
        if e.get("cat") in DEVICE_WORK:
            k = step_of.get(e.get("args", {}).get("correlation"))
            if k is not None:
                work[k].append(e)
    return work


def _step(work: list[dict], stores: list, gap_ms: float, before_ms: float) -> dict:
    if not work:
        return {"span_ms": 0.0, "load_stalls": [], "load_stall_ms": 0.0}
    t0 = min(_ms(e)[0] for e in work)
    out: dict = {"span_ms": round(max(_ms(e)[1] for e in work) - t0, 3)}
    kernels = [_ms(e) for e in work if e["cat"] == "kernel"]
    out["kernels_busy_ms"] = round(_busy_ms(kernels), 3)
    loads = []
    for kind in ("HtoD", "DtoH"):
        mine = [e for e in work if e["cat"] == "gpu_memcpy" and direction(e["name"]) == kind]
        nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in mine)
        out[kind] = {"bytes": nbytes, "busy_ms": round(_busy_ms([_ms(e) for e in mine]), 3)}
        if kind == "HtoD":
            loads = sorted((*_ms(e), int(e.get("args", {}).get("bytes", 0))) for e in mine)
    stalls, reach = [], None
    for start, end, nbytes in loads:
        if reach is not None and start - reach > gap_ms:
            ended = [
                {"stream": s, "bytes": b, "ended_ms_before": round(start - e, 3)}
                for (_, e, _, s, b) in stores
                if 0 <= start - e <= before_ms
            ]
            stalls.append(
                {
                    "at_ms": round(reach - t0, 3),
                    "ms": round(start - reach, 3),
                    "next_load_bytes": nbytes,
                    "stores_just_before": ended,
                }
            )
        reach = end if reach is None else max(reach, end)
    out["load_stalls"] = stalls
    out["load_stall_ms"] = round(sum(s["ms"] for s in stalls), 3)
    return out


KEPT = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "user_annotation")


def save_trace(events: list[dict], path: str) -> None:
    """The device's events of a chrome trace (kernels, copies, sets, the runtime calls that
    queue or wait for them, and the profiler ranges that say which step queued them: what
    ``summarize`` reads), gzipped: the host's operator events make it ten times larger."""
    kept = [e for e in events if e.get("cat") in KEPT or e.get("ph") == "M"]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": kept}, f)


def parse(argv):
    ap = argparse.ArgumentParser("loop_copies.py", description=__doc__.split("\n\n")[0])
    ours = [m for m in MODES if m.startswith("ours_")]
    ap.add_argument("--mode", required=True, choices=ours, help="one of training_loop.py's")
    ap.add_argument("--model", default="moe", choices=("dense", "moe"))
    ap.add_argument("--iters", type=int, default=2, help="profiled iterations (default 2)")
    ap.add_argument("--warmup", type=int, default=4, help="default 4 (graphs captured by then)")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="a load stall (default 1.0)")
    ap.add_argument("--tiny", action="store_true", help="tiny models for CPUs")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    ap.add_argument("--json", default=None, help="write the summary to this JSON file")
    ap.add_argument(
        "--trace", default=None, help="write the trace's device events (gzipped JSON) here"
    )
    args = ap.parse_args(argv)
    loop_argv = ["--models", args.model, "--modes", args.mode, "--warmup", str(args.warmup)]
    loop_argv += ["--tiny"] * args.tiny + (["--device", args.device] if args.device else [])
    return args, loop_parse(loop_argv)


def main(argv: list[str] | None = None) -> int:
    args, loop = parse(argv)
    if loop.device.type == "cuda":
        if loop.device.index is None:  # torch 2.11's set_device refuses a bare "cuda"
            loop.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(loop.device)
    cfg = config(args.model, loop)
    total = loop.warmup + args.iters
    gen = torch.Generator().manual_seed(loop.seed)
    tokens = torch.randint(cfg.vocab_size, (total, loop.batch, loop.seq), generator=gen)
    tokens = tokens.to(loop.device)
    meter = Meter(loop.device)
    copy = build(args.mode, cfg, loop, tokens, meter, None)  # warmed up
    activities = [torch.profiler.ProfilerActivity.CPU]
    if loop.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.iters):
            copy.iteration(tokens[copy.done], meter, timed=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    summary = summarize(events, args.gap_ms)
    summary["step_ms"] = [round(ms, 3) for ms in copy.step_ms]  # the profiled steps' GPU ms
    summary["iter_s"] = [round(s, 4) for s in copy.iter_s]
    if args.trace:
        save_trace(events, args.trace)
    result = {"info": environment(loop, None, ["bench/loop_copies.py", *(argv or sys.argv[1:])])}
    result |= {"mode": args.mode, "model": args.model, "iters": args.iters, **summary}
    print(f"steps GPU ms {summary['step_ms']}, iterations s {summary['iter_s']}")
    print(f"{args.model} {args.mode}: {summary['copies']} copies over {summary['window_ms']} ms")
    for stream, ways in summary["streams"].items():
        moved = ", ".join(
            f"{d} {v['bytes'] / 1e9:.3f} GB in {v['busy_ms']:.1f} ms"
            for d, v in ways.items()
            if v["bytes"]
        )
        print(f"  stream {stream}: {moved}")
    for k, step in enumerate(summary["steps"]):
        ways = ", ".join(
            f"{d} {step[d]['bytes'] / 1e9:.3f} GB busy {step[d]['busy_ms']:.1f} ms"
            for d in ("HtoD", "DtoH")
            if d in step
        )
        print(
            f"  step {k}: {step['span_ms']} ms, kernels busy {step.get('kernels_busy_ms', 0)} ms,"
            f" {ways}; {len(step['load_stalls'])} load stalls, {step['load_stall_ms']} ms"
        )
        for stall in step["load_stalls"][:10]:
            print(f"    at {stall['at_ms']} ms: {stall['ms']} ms; {stall['stores_just_before']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
