"""The host<->device copies of the training loop users write (bench/training_loop.py), for one
mode: a profiler pass over a few iterations after warm-up, and from its trace, per CUDA stream,
the bytes each way and the time busy copying; and the stalls of the loads: gaps longer than
``--gap-ms`` between one host-to-device copy's end and the next's start on the same stream,
each with the device-to-host copies that ended shortly before the next began (the stores
whose slots that load waited for, most likely).

    python bench/loop_copies.py --mode ours_offload_fp32 --json copies.json

A step whose loads stall behind stores shows it here in one call: which stream's stores, how
long, how often (docs/benchmarks.md, "The tail in slices").
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


def summarize(events: list[dict], gap_ms: float = 1.0, before_ms: float = 0.5) -> dict:
    """From chrome-trace events: per stream, bytes and busy ms each way; the loads' stalls (a
    gap over ``gap_ms`` between consecutive host-to-device copies of one stream), each with the
    device-to-host copies that ended within ``before_ms`` before the next load began."""
    copies = []
    for e in events:
        kind = direction(e.get("name", "")) if e.get("cat") == "gpu_memcpy" else None
        if kind is None:
            continue
        args = e.get("args", {})
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        copies.append((start, start + dur, kind, args.get("stream"), int(args.get("bytes", 0))))
    copies.sort()
    t0 = copies[0][0] if copies else 0.0
    streams: dict = defaultdict(lambda: {d: {"bytes": 0, "busy_ms": 0.0} for d in DIRECTIONS})
    for start, end, kind, stream, nbytes in copies:
        streams[stream][kind]["bytes"] += nbytes
        streams[stream][kind]["busy_ms"] += (end - start) / 1e3
    stores = [c for c in copies if c[2] == "DtoH"]
    stalls = []
    last_load: dict = {}
    for start, end, kind, stream, nbytes in copies:
        if kind != "HtoD":
            continue
        prev = last_load.get(stream)
        last_load[stream] = end
        if prev is None or (start - prev) / 1e3 <= gap_ms:
            continue
        ended = [
            {"stream": s, "bytes": b, "ended_ms_before": round((start - e) / 1e3, 3)}
            for (_, e, _, s, b) in stores
            if 0 <= start - e <= before_ms * 1e3
        ]
        stalls.append(
            {
                "at_ms": round((prev - t0) / 1e3, 3),
                "ms": round((start - prev) / 1e3, 3),
                "stream": stream,
                "next_load_bytes": nbytes,
                "stores_just_before": ended,
            }
        )
    return {
        "copies": len(copies),
        "window_ms": round((max(c[1] for c in copies) - t0) / 1e3, 3) if copies else 0.0,
        "streams": {str(s): v for s, v in streams.items()},
        "load_stalls": stalls,
        "load_stall_ms": round(sum(s["ms"] for s in stalls), 3),
    }


DEVICE_SIDE = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver")


def save_trace(events: list[dict], path: str) -> None:
    """The device's events of a chrome trace (kernels, copies, sets, and the runtime calls that
    queue or wait for them), gzipped: the host's operator events make it ten times larger."""
    kept = [e for e in events if e.get("cat") in DEVICE_SIDE or e.get("ph") == "M"]
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
    print(
        f"{args.model} {args.mode}: {summary['copies']} copies over {summary['window_ms']} ms; "
        f"{len(summary['load_stalls'])} load stalls, {summary['load_stall_ms']} ms"
    )
    for stream, ways in summary["streams"].items():
        moved = ", ".join(
            f"{d} {v['bytes'] / 1e9:.3f} GB in {v['busy_ms']:.1f} ms"
            for d, v in ways.items()
            if v["bytes"]
        )
        print(f"  stream {stream}: {moved}")
    for stall in summary["load_stalls"][:20]:
        print(f"  stall at {stall['at_ms']} ms: {stall['ms']} ms; {stall['stores_just_before']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
