"""Our resident Muon step against dion's, interleaved: ours over dion's on
``qwen3-30b-a3b-ep8-rank`` (the target: at most 0.6), measured so that a slow spell hits both.

    python bench/resident_vs_dion.py --dion-path DIR --out resident_vs_dion.json [--layers 48]
    python bench/resident_vs_dion.py --dion-path DIR --out rvd.json --chunk-mib 128 512 2048

Why interleaved: on the H200 the resident step was bimodal on 2026-11-29, about 0.155 s in
most steps and about 0.25 s in spells of a second or two that hit every optimizer stepping
then; a block of 7 consecutive steps can fall entirely inside one. On 2026-11-30 this script
found both steps bound by launches (the host returns from ``step()`` 8 to 9 ms before the card
is done) and its one slow step slow on the host.
Here the optimizers step the same parameters and gradients one after the other, in an order
that rotates by round; the figure is the median over rounds of ours / dion's in the same
round. ``--chunk-mib`` steps ours at several chunk sizes (in a resident step the chunk size
only sets how many same-shape matrices are orthogonalized together). Each step's SM clock is
recorded where NVML answers (``torch.cuda.clock_rate``), and the host's time to return from
``step()``. dion runs eagerly (torch.compile off), as in docs/benchmarks.md; ours at its
defaults (``cuda_graph="auto"``: replayed after the warm-up's capture), and with ``--eager``
also without graphs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

# dion eager: its compiled step never finished a first step on the H200 (docs/benchmarks.md,
# "Workloads"). Read when torch is imported; setting torch._dynamo.config.disable later
# breaks dion's fullgraph=True functions instead of running them eagerly.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from muon_offload import Muon  # noqa: E402
from muon_offload.tools import options  # noqa: E402
from muon_offload.tools.bench import machine  # noqa: E402
from muon_offload.tools.bench.modes import MUON_LR, build  # noqa: E402
from muon_offload.tools.bench.timing import Clock, rotated  # noqa: E402
from muon_offload.tools.workloads import WORKLOADS, workload  # noqa: E402


def sm_clock_mhz() -> int | None:
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # no NVML (pynvml) in this environment, or no GPU
        return None


def timed_step(opt, clock: Clock) -> dict:
    """The step's time, and the host's: when ``step()`` returned, before the device caught
    up. A host time close to the step's means the step is bound by launches, not kernels."""
    clock.sync()
    start = time.perf_counter()
    opt.step()
    host = time.perf_counter() - start
    clock.sync()
    return {"s": time.perf_counter() - start, "host_s": host, "sm_mhz": sm_clock_mhz()}


def main(argv: list[str] | None = None) -> int:
    ap = options.parser("resident_vs_dion.py", __doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--dion-path", required=True, help="folder holding the dion package")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument(
        "--workload", default="qwen3-30b-a3b-ep8-rank", choices=sorted(WORKLOADS), help="shapes"
    )
    ap.add_argument("--layers", type=int, default=None, help="first N layers (default: all)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds")
    ap.add_argument("--rounds", type=int, default=25, help="timed rounds")
    ap.add_argument(
        "--chunk-mib",
        type=int,
        nargs="+",
        default=None,
        help="ours at these chunk sizes (resident, it sets how many same-shape matrices are "
        "orthogonalized together), each against dion in the same rounds; default: ours' default",
    )
    ap.add_argument(
        "--gram-newton-schulz",
        action="store_true",
        help="also ours with use_gram_newton_schulz=True (default chunking), against the same "
        "dion step (its default orthogonalization), in the same rounds",
    )
    ap.add_argument(
        "--eager",
        action="store_true",
        help="also ours with cuda_graph=False (and, with --gram-newton-schulz, Gram Newton-Schulz "
        "so), in the same rounds: ours runs at default settings, cuda_graph='auto', otherwise",
    )
    args = ap.parse_args(argv)
    if args.chunk_mib is not None and min(args.chunk_mib) < 1:
        ap.error("--chunk-mib must be >= 1")

    sys.path.insert(0, args.dion_path)
    import dion

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    clock = Clock(device)
    groups, _, _ = build(workload(args.workload, args.layers), device)
    opts = {}
    for mib in args.chunk_mib or [None]:
        name = "ours" if mib is None else f"ours_{mib}mib"
        opts[name] = Muon(groups, lr=MUON_LR, chunk_bytes=None if mib is None else mib << 20)
    if args.gram_newton_schulz:
        opts["ours_gns"] = Muon(groups, lr=MUON_LR, use_gram_newton_schulz=True)
    if args.eager:
        opts["ours_eager"] = Muon(groups, lr=MUON_LR, cuda_graph=False)
        if args.gram_newton_schulz:
            opts["ours_gns_eager"] = Muon(
                groups, lr=MUON_LR, use_gram_newton_schulz=True, cuda_graph=False
            )
    ours = list(opts)
    opts["dion"] = dion.Muon(groups, lr=MUON_LR)
    for _ in range(args.warmup):
        for opt in opts.values():
            opt.step()
    steps: dict[str, list[dict]] = {name: [] for name in opts}
    for r in range(args.rounds):
        # Rotated, so no optimizer always steps first (or right after dion).
        for name in rotated(list(opts), r):
            steps[name].append(timed_step(opts[name], clock))

    ratios = {
        name: [o["s"] / d["s"] for o, d in zip(steps[name], steps["dion"], strict=True)]
        for name in ours
    }
    result = {
        "info": {
            "card": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "triton": machine.triton_version(),
            "date": machine.now(),
            "args": vars(args),
        },
        "median_ratio_to_dion": {name: statistics.median(r) for name, r in ratios.items()},
        "ratios": ratios,
    }
    for name, rows in steps.items():
        times = [row["s"] for row in rows]
        result[name] = {
            "median_s": statistics.median(times),
            "median_host_s": statistics.median(row["host_s"] for row in rows),
            "min_s": min(times),
            "max_s": max(times),
            "steps": rows,
        }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    width = max(map(len, opts))
    for name in opts:
        r = result[name]
        print(
            f"{name:<{width}} median {r['median_s']:.4f} s (min {r['min_s']:.4f}, max "
            f"{r['max_s']:.4f}), host {r['median_host_s']:.4f} s"
        )
    for name in ours:
        ratio = result["median_ratio_to_dion"][name]
        print(f"{name} / dion, median over {args.rounds} rounds: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
