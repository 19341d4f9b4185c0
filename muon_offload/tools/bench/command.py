"""``muon-offload bench``: the optimizer step on a named workload, every mode side by side.

    muon-offload bench [--workload NAME] [--layers N] [--out DIR] [--dion-path DIR]
                       [--torchao-offload]

Modes: ours resident (fp32 and 8-bit state), ours offloaded (fp32, bf16 and 8-bit state), the
all-at-once offload baseline (every state tensor to the GPU in one chunk, step, back), dion's
``Muon`` resident and all-at-once when dion is importable (eager, in a subprocess); on
AdamW-only workloads ``torch.optim.AdamW(fused=True)`` and, with ``--torchao-offload``,
torchao's ``CPUOffloadOptimizer`` (needs a CUDA GPU and torchao). On a GPU it first measures
pinned host<->device bandwidth each way alone and both at once, and the device-memory copy
bandwidth; the transfer floor of an offloaded mode is the bytes it streams each way over the
both-directions bandwidth: for ours the host bytes of its state as the optimizer reports them
(8-bit: codes and scales), for torchao the weights (gradients go down, weights come back).
For each mode: median, min and max step time over the timed steps (after warm-up, which
includes state creation, pinning and kernel tuning), the peak GPU memory the step adds above
weights and gradients, the host bytes of offloaded state, and the ratios to the floor and to
dion. Also one offloaded step's per-chunk timeline, chunk-size sweeps (fp32 and bf16 state),
and the offloaded and fp32 resident modes at 12 / 24 / 48 layers.

Writes ``bench.json`` and, with matplotlib, ``timeline.png`` and ``state_size.png`` into
``--out`` (a ``.json`` path names the JSON file; figures go beside it). Without a GPU the
resident and offloaded modes run through the CPU path (step time only).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .. import options
from ..workloads import ADAMW_ONLY, DEFAULT_LAYERS, MAX_LAYERS, WORKLOADS, workload

DESCRIPTION = "The optimizer step on a named workload, every mode side by side."
MEMORY_LAYERS = (12, 24, 48)
# The tiny workload's state is ~160 KiB: KiB-sized chunks, so its offloaded step streams in
# several pieces as the real workloads do with the default 128 MiB.
TINY_CHUNK_BYTES = 32 << 10
TINY_CHUNK_MIB = (1 / 32, 1 / 16, 1 / 8)
TINY_MEMORY_LAYERS = (2, 4, 8)  # seconds on a CPU, for CI
CHUNK_MIB = (32, 64, 128, 512)


def _size(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    ap = options.parser("muon-offload bench", DESCRIPTION)
    ap.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default=None,
        help="the parameter shapes to step (docs/benchmarks.md, Workloads); "
        "default: qwen3-30b-a3b-ep8-rank on a GPU, tiny without one",
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="keep the first N layers (default: all)"
    )
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
        type=_size,
        nargs="*",
        default=None,
        help="chunk sizes to sweep, MiB (default 32 64 128 512; KiB-sized for tiny)",
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each mode")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per mode")
    ap.add_argument(
        "--device",
        default=None,
        choices=("cuda", "cpu"),
        help="where parameters and gradients live (default: cuda where there is a CUDA GPU, "
        "else cpu)",
    )
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
    ap.add_argument(
        "--torchao-offload",
        action="store_true",
        help="also time torchao's CPUOffloadOptimizer (fused AdamW on the host) on an AdamW-only "
        f"workload ({', '.join(sorted(ADAMW_ONLY))}); needs a CUDA GPU and torchao",
    )
    ap.add_argument("--out", default="out/bench", help="folder for bench.json and the figures")
    return ap


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    import torch  # after the arguments: --help answers without it

    cuda = torch.cuda.is_available()
    if args.device is None:
        args.device = "cuda" if cuda else "cpu"
    if args.workload is None:
        args.workload = "qwen3-30b-a3b-ep8-rank" if cuda else "tiny"
    if args.device == "cuda" and not cuda:
        ap.error("--device cuda, but no CUDA GPU is available")
    if args.offload_only and args.device != "cuda":
        ap.error(
            "--offload-only measures offload to a GPU, and there is no CUDA GPU here"
            if not cuda
            else "--offload-only needs --device cuda"
        )
    most = MAX_LAYERS[args.workload]
    if args.layers is None:
        args.layers = DEFAULT_LAYERS[args.workload]
    for flag, counts in (("--layers", [args.layers]), ("--memory-layers", args.memory_layers)):
        for n in counts or []:
            if n < 1:
                ap.error(f"{flag} must be >= 1, got {n}")
            if most is not None and n > most:
                ap.error(f"{flag}: {args.workload} has {most} layers, got {n}")
    tiny = args.workload.startswith("tiny")
    if args.memory_layers is None:
        cap = most or max(MEMORY_LAYERS)
        layers = TINY_MEMORY_LAYERS if tiny else MEMORY_LAYERS
        args.memory_layers = sorted({min(n, cap) for n in layers})
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step creates the state)")
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.torchao_offload:
        torchao_check(ap, args)
    if args.chunk_bytes is not None and args.chunk_bytes < 1:
        ap.error("--chunk-bytes must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    if args.threads is None and tiny and args.device == "cpu":
        # Too small to split across threads: 1.4 ms a step on one, 0.37 s on two busy cores.
        args.threads = 1
    if args.chunk_bytes is None and tiny:
        args.chunk_bytes = TINY_CHUNK_BYTES
    if args.chunk_mib is None:
        args.chunk_mib = list(TINY_CHUNK_MIB if tiny else CHUNK_MIB)
    args.dion_root, args.dion_note = None, "left out (--no-dion)"
    if not args.no_dion:
        from .dion_runner import find_dion

        try:
            args.dion_root, args.dion_note = find_dion(args.dion_path)
        except FileNotFoundError as e:
            ap.error(str(e))
    return args


def torchao_check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error unless torchao's CPUOffloadOptimizer can run here: an AdamW-only workload,
    a CUDA GPU (it streams through one and asserts otherwise), and torchao installed."""
    import torch

    from .modes import torchao_missing

    flag = "--torchao-offload"
    if args.workload not in ADAMW_ONLY:
        ap.error(
            f"{flag} times AdamW-only workloads ({', '.join(sorted(ADAMW_ONLY))}); "
            f"{args.workload} has Muon parameters"
        )
    problems = []
    if args.device != "cuda":
        problems.append(
            "torchao's CPUOffloadOptimizer needs a CUDA GPU, and there is none here"
            if not torch.cuda.is_available()
            else "torchao's CPUOffloadOptimizer needs --device cuda"
        )
    missing = torchao_missing()
    if missing:
        problems.append(missing)
    if problems:
        ap.error(f"{flag}: " + "; ".join(problems))


def cpu_warning(args) -> str | None:
    """A warning where a GPU-sized workload is about to run on the CPU (None otherwise)."""
    if args.device != "cpu" or args.workload.startswith("tiny"):
        return None
    from .timing import GIB  # after parsing: torch is imported by then

    specs = workload(args.workload, args.layers)
    state = sum(s.numel * (4 if s.algorithm == "muon" else 8) for s in specs)
    return (
        f"muon-offload bench: warning: {args.workload} ({args.layers} layers, "
        f"{state / GIB:.2f} GiB of fp32 state) is sized for a GPU; on the CPU each mode's steps "
        "take minutes or more (--workload tiny runs in seconds)"
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
    """The bench itself (runner.py: torch and the modes are imported only for a run, so that
    ``--help`` and usage errors answer at once)."""
    from .runner import run as run_bench

    return run_bench(args)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    json_path, timeline_png, state_png = out_paths(args.out)
    warning = cpu_warning(args)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    # The optimizer's notices (CPU path, oversized chunks in a sweep) would interleave with the
    # progress lines; the JSON and the table say the same.
    package_log = logging.getLogger("muon_offload")
    level = package_log.level
    package_log.setLevel(logging.ERROR)
    try:
        results = run(args)
    finally:
        package_log.setLevel(level)
    from .figures import figures

    results["figures"] = figures(results, timeline_png, state_png)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    from .report import table

    print(table(results))
    print(f"\nwrote {json_path}" + "".join(f", {p}" for p in results["figures"].get("files", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
