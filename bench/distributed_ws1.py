"""Cost of the distributed code path on one GPU: the same workload stepped with no mesh, with a
world-size-1 ProcessGroup (replicated path), and as DTensors on a 1-rank DeviceMesh.

    python bench/distributed_ws1.py --out ws1.json [--layers 48]

Each mode: median of the timed steps after warm-up, resident and offloaded (fp32 state).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from muon_offload import Muon
from muon_offload.workloads import materialize, qwen3_30b_a3b_ep8_rank


def timed(opt, warmup, steps):
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))

    specs = qwen3_30b_a3b_ep8_rank(args.layers)
    params = materialize(specs, "cuda")
    muon_idx = [i for i, s in enumerate(specs) if s.algorithm == "muon"]
    adamw_idx = [i for i, s in enumerate(specs) if s.algorithm != "muon"]

    def groups(ps):
        return [
            dict(params=[ps[i] for i in muon_idx]),
            dict(params=[ps[i] for i in adamw_idx], algorithm="adamw", lr=1e-3),
        ]

    dtensors = []
    for p in params:  # views of the same storage: no copy
        d = torch.nn.Parameter(DTensor.from_local(p.detach(), mesh, [Shard(0)], run_check=False))
        d.grad = DTensor.from_local(p.grad, mesh, [Shard(0)], run_check=False)
        dtensors.append(d)

    results = {
        "info": {
            "card": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": vars(args),
        }
    }
    for offload in (False, True):
        for name, ps, kwargs in (
            ("plain", params, {}),
            ("process_group_ws1", params, {"distributed_mesh": dist.group.WORLD}),
            ("device_mesh_ws1_dtensor", dtensors, {"distributed_mesh": mesh}),
        ):
            key = f"{'offload' if offload else 'resident'}_{name}"
            print(f"  {key} ...", flush=True)
            opt = Muon(groups(ps), lr=0.01, offload=offload, **kwargs)
            results[key] = timed(opt, args.warmup, args.steps)
            del opt
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for mode in ("resident", "offload"):
        plain = results[f"{mode}_plain"]["median_s"]
        for name in ("plain", "process_group_ws1", "device_mesh_ws1_dtensor"):
            r = results[f"{mode}_{name}"]
            print(f"{mode:<9}{name:<26}{r['median_s']:>8.4f} s  x{r['median_s'] / plain:.3f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
