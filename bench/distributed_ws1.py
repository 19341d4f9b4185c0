"""Cost of the distributed code path on one GPU: the same workload stepped with no mesh, with a
world-size-1 ProcessGroup (replicated path), and as DTensors on a 1-rank DeviceMesh.

    python bench/distributed_ws1.py --out ws1.json [--layers 48]

Resident and offloaded (fp32 state): the three optimizers step in turn, round after round
(``interleaved``); each mode's overhead is the median over rounds of its time over plain's.
"""

from __future__ import annotations

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
from muon_offload.tools import options
from muon_offload.tools.bench import machine
from muon_offload.tools.bench.modes import ADAMW_LR, MUON_LR
from muon_offload.tools.bench.timing import Clock, rotated
from muon_offload.tools.workloads import materialize, qwen3_30b_a3b_ep8_rank


def interleaved(opts: dict, clock: Clock, where: str, warmup: int, rounds: int) -> dict:
    """Step every optimizer once per round, in an order rotated each round; the overhead is
    the median over rounds of each mode's time over plain's in the same round."""
    for _ in range(warmup):
        for opt in opts.values():
            opt.step()
    names = list(opts)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            clock.sync()
            start = time.perf_counter()
            opts[name].step()
            clock.sync()
            times[name].append(time.perf_counter() - start)
    out = {}
    for name in names:
        ratios = [t / p for t, p in zip(times[name], times["plain"], strict=True)]
        out[f"{where}_{name}"] = {
            "median_s": statistics.median(times[name]),
            "min_s": min(times[name]),
            "max_s": max(times[name]),
            "median_ratio_to_plain": statistics.median(ratios),
            "times_s": times[name],
        }
    return out


def main() -> int:
    ap = options.parser("distributed_ws1.py", __doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--layers", type=int, default=48, help="first N layers of the workload")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    ap.add_argument("--rounds", type=int, default=21, help="timed rounds")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    # Without a GPU (a check of the script itself): gloo and the CPU path.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,))

    specs = qwen3_30b_a3b_ep8_rank(args.layers)
    params = materialize(specs, device)
    muon_idx = [i for i, s in enumerate(specs) if s.algorithm == "muon"]
    adamw_idx = [i for i, s in enumerate(specs) if s.algorithm != "muon"]

    def groups(ps):
        return [
            dict(params=[ps[i] for i in muon_idx]),
            dict(params=[ps[i] for i in adamw_idx], algorithm="adamw", lr=ADAMW_LR),
        ]

    dtensors = []
    for p in params:  # views of the same storage: no copy
        d = torch.nn.Parameter(DTensor.from_local(p.detach(), mesh, [Shard(0)], run_check=False))
        d.grad = DTensor.from_local(p.grad, mesh, [Shard(0)], run_check=False)
        dtensors.append(d)

    results = {
        "info": {
            "card": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__,
            "date": machine.now(),
            "args": vars(args),
        }
    }
    modes = (
        ("plain", params, {}),
        ("process_group_ws1", params, {"distributed_mesh": dist.group.WORLD}),
        ("device_mesh_ws1_dtensor", dtensors, {"distributed_mesh": mesh}),
    )
    for offload in (False, True):
        where = "offload" if offload else "resident"
        print(f"  {where}: {', '.join(m[0] for m in modes)} ...", flush=True)
        opts = {name: Muon(groups(ps), lr=MUON_LR, offload=offload, **kw) for name, ps, kw in modes}
        results.update(
            interleaved(opts, Clock(torch.device(device)), where, args.warmup, args.rounds)
        )
        del opts
        if device == "cuda":
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for where in ("resident", "offload"):
        for name, _, _ in modes:
            r = results[f"{where}_{name}"]
            print(
                f"{where:<9}{name:<26}{r['median_s']:>8.4f} s  median ratio to plain "
                f"{r['median_ratio_to_plain']:.4f}"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
