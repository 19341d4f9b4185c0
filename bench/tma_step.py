"""The whole step with the TMA product configs offered (``MUON_OFFLOAD_TMA=1``) against
without, in the same rounds: is the switch worth turning on by default?

    python bench/tma_step.py --workload qwen3-30b-a3b-ep8-rank --out tma-step.json

The switch is read at every launch (``kernels/_tma.py``), and the tuner keys a decision by
it, so one optimizer steps under both settings: per round, each (mode, setting) pair steps
once, in rotated order. Modes: resident, and offloaded at ``--chunk-mib``, both eager (the
default; a replayed graph does not pay the launches' host cost). Figures: median step time
(synchronized before and after), median host time to issue the step (``step()`` returning),
and per mode the median over rounds of TMA-on / TMA-off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from muon_offload import Muon
from muon_offload.tools.bench import machine
from muon_offload.tools.bench.modes import MUON_LR, build
from muon_offload.tools.bench.timing import rotated
from muon_offload.tools.workloads import WORKLOADS, workload

SWITCH = "MUON_OFFLOAD_TMA"


def timed(opt, tma: bool) -> tuple[float, float]:
    """(step seconds, host seconds) of one step under the given setting."""
    os.environ[SWITCH] = "1" if tma else "0"
    torch.cuda.synchronize()
    start = time.perf_counter()
    opt.step()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return time.perf_counter() - start, host


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="qwen3-30b-a3b-ep8-rank", choices=sorted(WORKLOADS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--chunk-mib", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dev = torch.device("cuda")
    groups, _, _ = build(workload(args.workload, args.layers), dev)
    opts = {
        # Eager: a replayed graph would keep the TMA setting it was captured with.
        "resident": Muon(groups, lr=MUON_LR, cuda_graph=False),
        "offload": Muon(
            groups, lr=MUON_LR, offload=True, chunk_bytes=args.chunk_mib << 20, cuda_graph=False
        ),
    }
    runs = [(mode, tma) for mode in opts for tma in (False, True)]
    for _ in range(args.warmup):  # state, then tuning under each setting
        for mode, tma in runs:
            timed(opts[mode], tma)
    times: dict[tuple, list[tuple[float, float]]] = {run: [] for run in runs}
    for r in range(args.rounds):
        for mode, tma in rotated(runs, r):
            times[(mode, tma)].append(timed(opts[mode], tma))
    os.environ.pop(SWITCH)
    result = {"info": machine.record(dev, args)}
    print(f"{args.workload}, {args.rounds} rounds: median step s, host s; TMA on / off")
    for mode in opts:
        row = {}
        for tma in (False, True):
            steps, hosts = zip(*times[(mode, tma)], strict=True)
            row["tma_on" if tma else "tma_off"] = {
                "median_s": statistics.median(steps),
                "host_median_s": statistics.median(hosts),
                "steps_s": list(steps),
            }
        on, off = (times[(mode, t)] for t in (True, False))
        row["on_over_off"] = statistics.median([a[0] / b[0] for a, b in zip(on, off, strict=True)])
        result[mode] = row
        print(
            f"  {mode:<9} off {row['tma_off']['median_s']:.4f} s (host "
            f"{row['tma_off']['host_median_s']:.4f}), on {row['tma_on']['median_s']:.4f} s "
            f"(host {row['tma_on']['host_median_s']:.4f}), on / off {row['on_over_off']:.3f}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
