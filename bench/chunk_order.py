"""The offloaded step with its streamed chunks in the planner's run order (element-wise chunks
spread among the Muon ones, ``planner._interleave``) against the packed order (every Muon
chunk, then every element-wise one), and the resident step, in the same rounds.

    python bench/chunk_order.py --workload llama3-8b-fsdp8-rank --layers 8 32 --out order.json

Per layer count: a resident optimizer, and two offloaded ones at ``--chunk-mib`` that differ
only in the order their chunks run (the packed one plans with ``_interleave`` replaced by
the identity); they step the same parameters and gradients one after the other, rotated by
round; the figure is the median step time (synchronized before and after ``step()``), and
each offloaded mode's median over rounds of its time / the resident time of the same round.
Transfer floor: the streamed state bytes / the measured both-directions copy bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from muon_offload import Muon
from muon_offload.engine import planner
from muon_offload.tools.bench import machine
from muon_offload.tools.bench.modes import MUON_LR, build
from muon_offload.tools.bench.timing import bandwidths, rotated
from muon_offload.tools.workloads import WORKLOADS, workload

STATE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "int8": torch.int8}


@contextlib.contextmanager
def packed_order():
    """Plans made inside run their streamed chunks in packed order."""
    saved = planner._interleave
    planner._interleave = lambda chunks: chunks
    try:
        yield
    finally:
        planner._interleave = saved


def timed(opt, packed: bool) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with packed_order() if packed else contextlib.nullcontext():
        opt.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="llama3-8b-fsdp8-rank", choices=sorted(WORKLOADS))
    ap.add_argument("--layers", type=int, nargs="+", default=[None])
    ap.add_argument("--chunk-mib", type=int, default=128)
    ap.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default="fp32")
    ap.add_argument("--cuda-graph", action="store_true", help="every optimizer with it")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dev = torch.device("cuda")
    both_each = bandwidths()["both_each"] * 1e9
    result = {
        "info": {
            **machine.record(dev, args),
            "both_directions_each_gbps": both_each / 1e9,
        }
    }
    for layers in args.layers:
        groups, _, _ = build(workload(args.workload, layers), dev)
        common = dict(
            lr=MUON_LR, state_dtype=STATE_DTYPES[args.state_dtype], cuda_graph=args.cuda_graph
        )
        opts = {
            "resident": Muon(groups, **common),
            "offload_interleaved": Muon(
                groups, offload=True, chunk_bytes=args.chunk_mib << 20, **common
            ),
            "offload_packed": Muon(
                groups, offload=True, chunk_bytes=args.chunk_mib << 20, **common
            ),
        }
        packed = {"offload_packed"}
        for _ in range(args.warmup):
            for name, opt in opts.items():
                timed(opt, name in packed)
        times: dict[str, list[float]] = {name: [] for name in opts}
        for r in range(args.rounds):
            for name in rotated(list(opts), r):
                times[name].append(timed(opts[name], name in packed))
        streamed = opts["offload_interleaved"].host_state_bytes
        row = {name: {"median_s": statistics.median(t), "steps_s": t} for name, t in times.items()}
        for name in ("offload_interleaved", "offload_packed"):
            ratios = [o / r for o, r in zip(times[name], times["resident"], strict=True)]
            row[name]["to_resident"] = statistics.median(ratios)
        row["floor_s"] = streamed / both_each
        key = f"layers_{layers if layers is not None else 'all'}"
        result[key] = row
        print(f"{args.workload} {key} ({args.state_dtype}, {args.chunk_mib} MiB):", flush=True)
        for name, r in row.items():
            if isinstance(r, dict):
                extra = f", / resident {r['to_resident']:.3f}" if "to_resident" in r else ""
                print(f"  {name:<20} median {r['median_s']:.4f} s{extra}")
        print(f"  transfer floor       {row['floor_s']:.4f} s")
        del opts, groups
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
