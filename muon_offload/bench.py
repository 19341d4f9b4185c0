"""``muon-offload bench``: the optimizer step on a named workload, every mode side by side.

    muon-offload bench [--workload NAME] [--layers N] [--out DIR] [--dion-path DIR]

Modes: ours resident, ours offloaded (fp32 and bf16 state), the all-at-once offload baseline
(every state tensor to the GPU in one chunk, step, back), dion's ``Muon`` resident and
all-at-once when dion is importable (eager, in a subprocess), and ``torch.optim.AdamW(fused=True)``
on AdamW-only workloads. On a GPU it first measures pinned host<->device bandwidth each way
alone and both at once, and the device-memory copy bandwidth; the transfer floor of an
offloaded mode is its state bytes over the both-directions bandwidth (each direction moves the
state once). For each mode: median, min and max step time over the timed steps (after warm-up,
which includes state creation, pinning and kernel tuning), the peak GPU memory the step adds
above weights and gradients, and the ratios to the floor and to dion. Also one offloaded step's
per-chunk timeline, chunk-size sweeps, and every mode at 12 / 24 / 48 layers.

Writes ``bench.json`` and, with matplotlib, ``timeline.png`` and ``state_size.png`` into
``--out`` (a ``.json`` path names the JSON file; figures go beside it). Without a GPU the
resident and offloaded modes run through the CPU path (step time only).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .collectives import local
from .workloads import DEFAULT_LAYERS, MAX_LAYERS, WORKLOADS, materialize, workload

GIB = 1 << 30
MIB = 1 << 20
MEMORY_LAYERS = (12, 24, 48)
# The tiny workload's state is ~160 KiB: KiB-sized chunks, so its offloaded step streams in
# several pieces as the real workloads do with the default 128 MiB.
TINY_CHUNK_BYTES = 32 << 10
TINY_CHUNK_MIB = (1 / 32, 1 / 16, 1 / 8)
TINY_MEMORY_LAYERS = (2, 4, 8)  # seconds on a CPU, for CI
CHUNK_MIB = (32, 64, 128, 512)
NO_GPU = "no CUDA GPU: nothing crosses PCIe, and peak GPU memory is not measured"


# ------------------------------------------------------------------------------ timing


class Clock:
    """Host timing that waits for the device before each reading when there is one."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_added_gib(self, base: int) -> float | None:
        return (torch.cuda.max_memory_allocated() - base) / GIB if self.cuda else None

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def time_steps(opt, clock: Clock, warmup: int, steps: int, base: int) -> dict:
    for _ in range(warmup):
        opt.step()
    clock.sync()
    clock.reset_peak()
    times = []
    for _ in range(steps):
        clock.sync()
        t = time.perf_counter()
        opt.step()
        clock.sync()
        times.append(time.perf_counter() - t)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "steps": steps,
        "peak_added_gib": clock.peak_added_gib(base),
    }


def bandwidths(
    nbytes: int = GIB,
    reps: int = 5,
    *,
    before_each: Callable[[], None] = torch.cuda.synchronize,
    device_copy: bool = True,
) -> dict:
    """GB/s (1e9 bytes/s): h2d alone, d2h alone, each direction when both run at once, and
    (``device_copy``) the device copy (bytes read + written). ``before_each`` starts every
    repetition; several ranks pass a barrier, so they all copy in the same phase."""
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn):
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            before_each()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
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
    }
    if device_copy:
        out["device_copy"] = 2 * nbytes / timed(lambda: dev_b.copy_(dev_a)) / 1e9
    return out


def timeline(opt, clock: Clock) -> list[dict]:
    """One step's per-chunk stages, ms from the step's first mark. On the GPU: CUDA events on
    each stream (load, update, store). On the CPU the copies run serially between updates and
    are timed together as ``copies`` (the previous chunk's store and this chunk's load)."""
    sched = opt._scheduler
    if clock.cuda:
        sched.timeline = []
        clock.sync()
        opt.step()
        clock.sync()
        marks, sched.timeline = sched.timeline, None
        ref = marks[0][2]  # the first event recorded; times may be negative relative to it
        rows = [
            {"chunk": c, "stage": s, "start_ms": ref.elapsed_time(a), "end_ms": ref.elapsed_time(b)}
            for c, s, a, b in marks
        ]
    else:
        rows = _cpu_timeline(opt, sched)
    t0 = min(r["start_ms"] for r in rows)
    for r in rows:
        r["start_ms"] -= t0
        r["end_ms"] -= t0
    return rows


def _cpu_timeline(opt, sched) -> list[dict]:
    rows: list[dict] = []
    run = sched.run
    last_end = [None]

    def timed_run(transfers, update):
        def timed_update(i, views):
            start = time.perf_counter() * 1e3
            if views is not None and last_end[0] is not None:
                rows.append(
                    {"chunk": i, "stage": "copies", "start_ms": last_end[0], "end_ms": start}
                )
            update(i, views)
            last_end[0] = time.perf_counter() * 1e3
            rows.append({"chunk": i, "stage": "update", "start_ms": start, "end_ms": last_end[0]})

        last_end[0] = time.perf_counter() * 1e3
        run(transfers, timed_update)
        end = time.perf_counter() * 1e3
        if transfers and transfers[-1] is not None:
            rows.append(
                {
                    "chunk": len(transfers) - 1,
                    "stage": "copies",
                    "start_ms": last_end[0],
                    "end_ms": end,
                }
            )

    sched.run = timed_run  # this instance only, for one step
    try:
        opt.step()
    finally:
        del sched.run
    return rows


# ---------------------------------------------------------------------------- the modes


def build(specs, device: torch.device, seed: int = 0):
    """Parameter groups as a training script would pass them (Muon matrices, an AdamW group),
    the fp32 state bytes of the workload, and the bytes of weights and gradients."""
    params = materialize(specs, device, seed=seed)
    muon = [p for p, s in zip(params, specs, strict=True) if s.algorithm == "muon"]
    adamw = [p for p, s in zip(params, specs, strict=True) if s.algorithm != "muon"]
    groups = []
    if muon:
        groups.append(dict(params=muon))
    if adamw:
        groups.append(dict(params=adamw, algorithm="adamw", lr=1e-3))
    state = 4 * (sum(p.numel() for p in muon) + 2 * sum(p.numel() for p in adamw))
    weights_and_grads = sum(2 * p.numel() * p.element_size() for p in params)
    return groups, state, weights_and_grads


def state_dict_cost(opt, clock: Clock) -> dict:
    """What saving an offloaded optimizer costs: ``state_dict()`` itself, then reading every
    tensor it returns once (copied into one pageable buffer, as a serializer would), against
    reading the host slabs directly into the same buffer; and the GPU memory the call adds."""
    clock.sync()
    allocated = torch.cuda.memory_allocated() if clock.cuda else 0
    clock.reset_peak()
    t = time.perf_counter()
    sd = opt.state_dict()
    call_s = time.perf_counter() - t
    clock.sync()
    peak_added = torch.cuda.max_memory_allocated() - allocated if clock.cuda else None
    tensors = [v for vals in sd["state"].values() for v in vals.values() if torch.is_tensor(v)]
    nbytes = sum(v.numel() * v.element_size() for v in tensors)
    slabs = opt._host.slabs if opt._host is not None else []
    buffer = torch.empty(max(nbytes, sum(s.numel() for s in slabs)), dtype=torch.uint8)
    buffer.fill_(1)  # fault the pages in before timing

    def copy_all(sources) -> float:
        start, offset = time.perf_counter(), 0
        for src in sources:
            flat = src.reshape(-1).view(torch.uint8)
            buffer[offset : offset + flat.numel()].copy_(flat)
            offset += flat.numel()
        return time.perf_counter() - start

    return {
        "state_bytes": nbytes,
        "call_s": call_s,
        "read_through_state_dict_s": copy_all(tensors),
        "read_slabs_s": copy_all(slabs),
        "peak_added_bytes": peak_added,
        "threads": torch.get_num_threads(),
    }


def _reconfigure(opt, chunk_bytes: int) -> None:
    """Same host state, another chunk size: a fresh plan and staging ring."""
    opt.chunk_bytes, opt._scheduler = chunk_bytes, None
    opt._plans.clear()


def run_modes(specs, args, clock: Clock, progress, *, warmup: int, steps: int, full: bool):
    """Every one of our modes on one copy of the workload. ``full`` adds the timelines and the
    chunk-size sweeps (the main run); the memory-by-layers runs leave them out."""
    from . import Muon

    device = torch.device(args.device)
    groups, state_bytes, base = build(specs, device)
    adamw_only = all(g.get("algorithm") == "adamw" for g in groups)
    out: dict = {"state_gib": state_bytes / GIB}

    def timed(name, opt, warm=warmup):
        progress(name)
        out[name] = time_steps(opt, clock, warm, steps, base)

    if not args.offload_only:
        timed("ours_resident", Muon(groups, lr=0.01))
        clock.free()

    def sweep(opt, key):
        out[key] = {}
        for mib in args.chunk_mib:
            _reconfigure(opt, max(1, round(mib * MIB)))
            clock.free()
            progress(f"{key} {mib:g} MiB")
            out[key][f"{mib:g}"] = time_steps(opt, clock, 1, steps, base)

    opt = Muon(groups, lr=0.01, offload=True, chunk_bytes=args.chunk_bytes)
    timed("ours_offload_fp32", opt)
    if full:
        progress("state_dict")
        out["state_dict"] = state_dict_cost(opt, clock)
        out["timeline_fp32"] = timeline(opt, clock)
        sweep(opt, "chunk_sweep")
    _reconfigure(opt, 1 << 50)  # everything in one chunk
    clock.free()
    timed("all_at_once", opt, warm=1)
    del opt
    clock.free()

    opt = Muon(
        groups, lr=0.01, offload=True, chunk_bytes=args.chunk_bytes, state_dtype=torch.bfloat16
    )
    timed("ours_offload_bf16", opt)
    if full:
        out["timeline_bf16"] = timeline(opt, clock)
        sweep(opt, "chunk_sweep_bf16")
    del opt
    clock.free()

    if not adamw_only:
        out["torch_adamw_fused"] = {
            "skipped": "not applicable: the workload has Muon parameters "
            "(torch's fused AdamW is compared on AdamW-only workloads)"
        }
    elif not args.offload_only:
        params = [p for g in groups for p in g["params"]]
        timed("torch_adamw_fused", torch.optim.AdamW(params, lr=1e-3, fused=True))
        clock.free()
    return out


# ---------------------------------------------------------------------------------- dion


def find_dion(path: str | None) -> tuple[str | None, str | None]:
    """(the folder that holds the ``dion`` package, None) or (None, why dion is not run)."""
    if path:
        if not os.path.isfile(os.path.join(path, "dion", "__init__.py")):
            raise FileNotFoundError(f"--dion-path {path}: no dion/__init__.py there")
        return os.path.abspath(path), None
    spec = importlib.util.find_spec("dion")
    if spec is None or spec.origin is None:
        return None, "dion is not installed (pip install it, or pass --dion-path DIR)"
    return os.path.dirname(os.path.dirname(spec.origin)), None


def dion_commit(root: str) -> str | None:
    if os.environ.get("DION_COMMIT"):
        return os.environ["DION_COMMIT"]
    if not os.path.exists(os.path.join(root, ".git")) or shutil.which("git") is None:
        return None
    proc = subprocess.run(
        ["git", "-C", root, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True
    )
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def run_dion(args, root: str, runs: list[dict]) -> list[dict]:
    """dion's Muon, eager (torch.compile off, as ANCHORS.md measured it), in a subprocess so
    that its imports and memory stay out of ours."""
    env = dict(
        os.environ,
        TORCHDYNAMO_DISABLE="1",
        PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    )
    job = dict(workload=args.workload, device=args.device, threads=args.threads, runs=runs)
    cmd = [sys.executable, "-m", "muon_offload.bench", "--dion-worker", json.dumps(job)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return [{"error": "dion did not finish within 30 minutes"} for _ in runs]
    if proc.returncode != 0:
        return [{"error": proc.stderr[-2000:]} for _ in runs]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class AllAtOnce:
    """ANCHORS.md's all-at-once offload baseline around a resident optimizer: every state
    tensor copied from persistent (pinned, on a GPU) host buffers to the device, the step,
    and every one copied back. DTensor state is this rank's local tensors."""

    def __init__(self, opt, keys: tuple[str, ...], pin: bool):
        self.opt = opt
        self.state = [local(t) for s in opt.state.values() for k, t in s.items() if k in keys]
        self.host = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t) for t in self.state
        ]

    def step(self) -> None:
        for t, h in zip(self.state, self.host, strict=True):
            t.copy_(h, non_blocking=True)
        self.opt.step()
        for t, h in zip(self.state, self.host, strict=True):
            h.copy_(t, non_blocking=True)


def dion_worker(job: dict) -> None:
    import dion

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    clock = Clock(device)
    results = []
    for run in job["runs"]:
        groups, _, base = build(workload(job["workload"], run["layers"]), device)
        opt = dion.Muon(groups, lr=0.01)
        r = time_steps(opt, clock, run["warmup"], run["steps"], base)

        baseline = AllAtOnce(opt, ("momentum", "variance"), pin=clock.cuda)
        r["all_at_once"] = time_steps(baseline, clock, 1, run["steps"], base)
        results.append(r)
        del opt, groups, baseline
        clock.free()
    print(json.dumps(results))


# ------------------------------------------------------------------------------- running


class Progress:
    """One line per stage with the seconds since the start (tqdm's bar when it is installed)."""

    def __init__(self, total: int):
        self.start = time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, unit="stage", file=sys.stderr, leave=False)

    def __call__(self, stage: str) -> None:
        if self.bar is not None:
            self.bar.set_description(stage)
            self.bar.update(1)
        else:
            print(
                f"[{time.perf_counter() - self.start:7.1f} s] {stage}", file=sys.stderr, flush=True
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _size_list(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parse(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="muon-offload bench", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="qwen3-30b-a3b-ep8-rank" if cuda else "tiny",
        help="default: qwen3-30b-a3b-ep8-rank on a GPU, tiny without one",
    )
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    ap.add_argument(
        "--memory-layers",
        type=int,
        nargs="*",
        default=None,
        help="layer counts for step time and memory against state size "
        "(default 12 24 48, capped at the workload's layers; 2 4 8 for tiny)",
    )
    ap.add_argument(
        "--chunk-bytes",
        type=int,
        default=None,
        help="chunk size of the offloaded modes (default: the optimizer's; "
        f"{TINY_CHUNK_BYTES} for tiny)",
    )
    ap.add_argument(
        "--chunk-mib",
        type=_size_list,
        nargs="*",
        default=None,
        help="chunk sizes to sweep, MiB (default 32 64 128 512; KiB-sized for tiny)",
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--device", default="cuda" if cuda else "cpu", choices=("cuda", "cpu"))
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: 1 for tiny on the CPU, else torch's)",
    )
    ap.add_argument(
        "--offload-only", action="store_true", help="only the offloaded modes (needs a GPU)"
    )
    ap.add_argument(
        "--dion-path",
        default=None,
        help="folder holding the dion package (default: an importable dion)",
    )
    ap.add_argument("--no-dion", action="store_true", help="leave dion out")
    ap.add_argument("--out", default="out/bench", help="folder for bench.json and the figures")
    ap.add_argument("--dion-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dion_worker:
        return args

    if args.device == "cuda" and not cuda:
        ap.error("--device cuda, but no CUDA GPU is available")
    if args.offload_only and args.device != "cuda":
        ap.error(
            "--offload-only measures offload to a GPU, and there is no CUDA GPU here"
            if not cuda
            else "--offload-only needs --device cuda"
        )
    default = DEFAULT_LAYERS[args.workload]
    most = MAX_LAYERS[args.workload]
    if args.layers is None:
        args.layers = default
    for flag, counts in (("--layers", [args.layers]), ("--memory-layers", args.memory_layers)):
        for n in counts or []:
            if n < 1:
                ap.error(f"{flag} must be >= 1, got {n}")
            if most is not None and n > most:
                ap.error(f"{flag}: {args.workload} has {most} layers, got {n}")
    tiny = args.workload == "tiny"
    if args.memory_layers is None:
        cap = most or max(MEMORY_LAYERS)
        layers = TINY_MEMORY_LAYERS if tiny else MEMORY_LAYERS
        args.memory_layers = sorted({min(n, cap) for n in layers})
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step creates the state)")
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.chunk_bytes is not None and args.chunk_bytes < 1:
        ap.error("--chunk-bytes must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    if args.threads is None and tiny and args.device == "cpu":
        # Tiny's matrices are too small to split across threads; measured on a 2-core machine
        # whose cores other jobs were using, two threads took 0.37 s a step against 1.4 ms
        # with one.
        args.threads = 1
    if args.chunk_bytes is None and tiny:
        args.chunk_bytes = TINY_CHUNK_BYTES
    if args.chunk_mib is None:
        args.chunk_mib = list(TINY_CHUNK_MIB if tiny else CHUNK_MIB)
    args.dion_root, args.dion_note = None, "left out (--no-dion)"
    if not args.no_dion:
        try:
            args.dion_root, args.dion_note = find_dion(args.dion_path)
        except FileNotFoundError as e:
            ap.error(str(e))
    return args


def environment(args) -> dict:
    cuda = args.device == "cuda"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    driver = None
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        driver = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 else None
    card = (
        torch.cuda.get_device_name()
        if cuda
        else f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    )
    args_json = {k: v for k, v in vars(args).items() if k not in ("dion_worker",)}
    return {
        "card": card,
        "device": args.device,
        "driver": driver,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "dion_commit": dion_commit(args.dion_root) if args.dion_root else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": args_json,
    }


def _ratios(results: dict) -> None:
    """Each mode's median over its transfer floor and over dion's resident median."""
    floor = results["floor"]
    dion = results.get("dion_resident", {})
    floors = {
        "ours_offload_fp32": floor["fp32"]["floor_s"],
        "all_at_once": floor["fp32"]["floor_s"],
        "ours_offload_bf16": floor["bf16"]["floor_s"],
    }
    modes = [(k, results[k]) for k in MODE_NAMES if "median_s" in results.get(k, {})]
    if "median_s" in dion.get("all_at_once", {}):
        modes.append(("dion_all_at_once", dion["all_at_once"]))
        floors["dion_all_at_once"] = floor["fp32"]["floor_s"]
    for key, m in modes:
        fl = floors.get(key)
        m["to_floor"] = m["median_s"] / fl if fl else None
        m["to_dion"] = m["median_s"] / dion["median_s"] if "median_s" in dion else None


MODE_NAMES = (
    "ours_resident",
    "ours_offload_fp32",
    "ours_offload_bf16",
    "all_at_once",
    "torch_adamw_fused",
    "dion_resident",
)


def out_paths(out: str) -> tuple[Path, Path, Path]:
    path = Path(out)
    if path.suffix == ".json":
        path.parent.mkdir(parents=True, exist_ok=True)
        return (
            path,
            path.with_name(path.stem + "-timeline.png"),
            path.with_name(path.stem + "-state_size.png"),
        )
    path.mkdir(parents=True, exist_ok=True)
    return path / "bench.json", path / "timeline.png", path / "state_size.png"


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = Clock(device)
    use_dion = args.dion_root is not None
    others = [n for n in args.memory_layers if n != args.layers]
    stages = 7 + 2 * len(args.chunk_mib) + 4 * len(others) + use_dion + (device.type == "cuda")
    progress = Progress(stages)
    results: dict = {"info": environment(args)}
    if clock.cuda:
        progress("bandwidths")
        results["bandwidth_gbps"] = bandwidths()
        clock.free()
    else:
        results["bandwidth_gbps"] = None
        results["bandwidth_note"] = NO_GPU

    def stage(layers):
        return lambda name: progress(f"{args.workload} {layers} layers: {name}")

    specs = workload(args.workload, args.layers)
    main = run_modes(
        specs, args, clock, stage(args.layers), warmup=args.warmup, steps=args.steps, full=True
    )
    state = main.pop("state_gib") * GIB
    bw = results["bandwidth_gbps"]
    results["floor"] = {
        name: {
            "state_gib": state * k / GIB,
            "floor_s": state * k / (bw["both_each"] * 1e9) if bw else None,
        }
        for name, k in (("fp32", 1.0), ("bf16", 0.5))
    }
    if not bw:
        results["floor_note"] = NO_GPU
    results.update(main)

    memory = {}
    for layers in args.memory_layers:
        if layers == args.layers:
            modes = {k: main[k] for k in MODE_NAMES if k in main}
            memory[layers] = {"state_gib": state / GIB, "modes": modes}
        else:
            r = run_modes(
                workload(args.workload, layers),
                args,
                clock,
                stage(layers),
                warmup=2,
                steps=3,
                full=False,
            )
            memory[layers] = {"state_gib": r.pop("state_gib"), "modes": r}
        # The offloaded fp32 figures at the top level, where earlier runs kept them.
        memory[layers].update(memory[layers]["modes"]["ours_offload_fp32"])
    results["memory_by_layers"] = memory

    if use_dion and not args.offload_only:
        progress("dion (eager, subprocess)")
        runs = [dict(layers=args.layers, warmup=args.warmup, steps=args.steps)]
        runs += [dict(layers=n, warmup=2, steps=3) for n in others]
        dion = run_dion(args, args.dion_root, runs)
        results["dion_resident"] = dict(dion[0], commit=results["info"]["dion_commit"])
        for n, r in zip(others, dion[1:], strict=True):
            memory[n]["modes"]["dion_resident"] = r
        if args.layers in memory:
            memory[args.layers]["modes"]["dion_resident"] = results["dion_resident"]
    else:
        note = "left out (--offload-only)" if use_dion else args.dion_note
        results["dion_resident"] = {"skipped": note}
    _ratios(results)
    progress("figures")
    progress.close()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.dion_worker:
        dion_worker(json.loads(args.dion_worker))
        return 0
    json_path, timeline_png, state_png = out_paths(args.out)
    # The engine's notices (CPU path, oversized chunks in a sweep) would interleave with the
    # progress lines; the JSON and the table say the same.
    engine_log = logging.getLogger("muon_offload.engine")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)
    try:
        results = run(args)
    finally:
        engine_log.setLevel(level)
    from .bench_report import figures, table

    results["figures"] = figures(results, timeline_png, state_png)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    print(f"\nwrote {json_path}" + "".join(f", {p}" for p in results["figures"].get("files", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
