"""Where a resident Muon step spends its time: torch.profiler over a few steps of ours (and
dion's, with ``--dion-path``) on the bench workload, GPU kernels grouped by name.

    python bench/profile_step.py --out profile.json [--layers 48] [--dion-path DIR]
    python bench/profile_step.py --out p.json --workload llama3-8b-fsdp8-rank --cuda-graph

Prints the step's wall time, the summed GPU kernel time and the top kernels; the JSON keeps
every kernel's total and count. GPU idle time (wall minus kernel time) is host overhead:
launches, Python, the tuner's lookups. ``--gram-newton-schulz`` and ``--cuda-graph`` add ours with
that setting (each alone), so one run shows what either changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

# dion eager: its compiled step never finished a first step on the H200 (docs/benchmarks.md,
# "Workloads"). Read when torch is imported; setting torch._dynamo.config.disable later
# breaks dion's fullgraph=True functions instead of running them eagerly.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile

from muon_offload import Muon
from muon_offload.tools.bench.modes import build
from muon_offload.tools.workloads import WORKLOADS, workload


def profiled(opt, steps: int) -> dict:
    # The first steps tune the kernels; with cuda_graph=True the third captures the step.
    print("warming up ...", flush=True)
    for _ in range(4):
        opt.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name[:90]]
            k[0] += e.device_time_total / 1e6 / steps
            k[1] += 1
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {
        "wall_s": wall,
        "kernel_s": sum(v[0] for v in kernels.values()),
        "launches_per_step": sum(v[1] for v in kernels.values()) / steps,
        "kernels": [{"name": n, "s": s, "count": c / steps} for n, (s, c) in ranked],
    }


def report(name: str, r: dict) -> None:
    print(
        f"{name}: wall {r['wall_s']:.4f} s/step, GPU kernels {r['kernel_s']:.4f} s, "
        f"{r['launches_per_step']:.0f} launches/step"
    )
    for k in r["kernels"][:14]:
        print(f"  {k['s'] * 1e3:9.2f} ms {k['count']:7.0f}x  {k['name']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--workload", default="qwen3-30b-a3b-ep8-rank", choices=sorted(WORKLOADS), help="shapes"
    )
    ap.add_argument("--layers", type=int, default=None, help="first N layers (default: all)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dion-path", default=None, help="folder holding the dion package")
    ap.add_argument("--gram-newton-schulz", action="store_true", help="also ours with it")
    ap.add_argument("--cuda-graph", action="store_true", help="also ours with cuda_graph=True")
    args = ap.parse_args()
    groups, _, _ = build(workload(args.workload, args.layers), torch.device("cuda"))
    results = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "workload": args.workload,
        "layers": args.layers,
    }
    variants = {"ours_resident": {"cuda_graph": False}}  # eager: the launches are profiled
    if args.gram_newton_schulz:
        variants["ours_resident_gns"] = {"use_gram_newton_schulz": True, "cuda_graph": False}
    if args.cuda_graph:
        variants["ours_resident_graph"] = {"cuda_graph": True}
    for name, kwargs in variants.items():
        opt = Muon(groups, lr=0.01, **kwargs)
        results[name] = profiled(opt, args.steps)
        report(name.replace("_", " "), results[name])
        del opt
    if args.dion_path:
        sys.path.insert(0, args.dion_path)
        from dion import Muon as DionMuon

        opt = DionMuon(groups, lr=0.01)
        results["dion_resident"] = profiled(opt, args.steps)
        report("dion resident", results["dion_resident"])
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
