"""Offloaded and resident steps with fp32 and 8-bit state on the qwen3 workload (one GPU):
seconds a step, host bytes, the peak GPU memory added, and whether offloaded and resident
8-bit (and fp32) give the same bits (a per-tensor digest of every weight after the last step).

    python bench/int8_step.py --layers 8 --out int8-step.json      # H200: ~15 s
    python bench/int8_step.py --layers 48 --steps 7 --chunk-mib 256 512 --out int8-48.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from muon_offload import Muon
from muon_offload.tools.bench.modes import build
from muon_offload.tools.workloads import qwen3_30b_a3b_ep8_rank


def _digest(p: torch.Tensor) -> int:
    bits = p.detach().view(torch.int32 if p.element_size() == 4 else torch.int16)
    return int(bits.sum(dtype=torch.int64))


def run(
    layers: int,
    offload: bool,
    state_dtype,
    warmup: int = 2,
    steps: int = 3,
    chunk_mib: float | None = None,
    **options,
) -> dict:
    groups, _, _ = build(qwen3_30b_a3b_ep8_rank(layers), torch.device("cuda"))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if chunk_mib is not None:
        options["chunk_bytes"] = round(chunk_mib * 2**20)
    opt = Muon(groups, offload=offload, state_dtype=state_dtype, **options)
    for _ in range(warmup):
        opt.step()
    torch.cuda.synchronize()
    first_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    total, host = [], []  # per step, synchronized before and after: the host's share is the
    for _ in range(steps):  # time step() takes to return
        start = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        total.append(time.perf_counter() - start)
    row = dict(
        mode=f"{'offload' if offload else 'resident'} {state_dtype or 'fp32'}",
        layers=layers,
        chunk_mib=chunk_mib,
        options={k: v for k, v in options.items() if k != "chunk_bytes"},
        s_per_step=statistics.median(total),
        s_min=min(total),
        host_s_per_step=statistics.median(host),
        host_gib=opt.host_state_bytes / 2**30 if offload else 0.0,
        staging_gib=opt.staging_bytes / 2**30,
        peak_added_gib_warmup=first_peak / 2**30,
        peak_added_gib_steady=(torch.cuda.max_memory_allocated() - base) / 2**30,
        digest=[_digest(p) for g in groups for p in g["params"]],
    )
    del opt, groups
    # The optimizer holds reference cycles: without a collection its CUDA graph (and the graph's
    # memory pool) outlived it into the next mode's readings (negative peaks, 2026-12-01).
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (state, tuning)")
    ap.add_argument(
        "--chunk-mib",
        type=float,
        nargs="*",
        default=[],
        help="then offloaded 8-bit state at these chunk budgets (MiB; Muon counts fp32 width)",
    )
    ap.add_argument(
        "--cuda-graph", action="store_true", help="every mode with cuda_graph=True (issue 17)"
    )
    args = ap.parse_args()
    extra = {"cuda_graph": args.cuda_graph}  # eager unless asked, as docs/ figures were taken
    rows = [
        run(args.layers, offload, sd, warmup=args.warmup, steps=args.steps, **extra)
        for offload in (True, False)
        for sd in (None, torch.int8)
    ]
    for r in rows:
        print({k: v for k, v in r.items() if k != "digest"}, flush=True)
    same = {sd: rows[i]["digest"] == rows[i + 2]["digest"] for i, sd in enumerate(("fp32", "int8"))}
    print("offloaded == resident, bit for bit (digest of every weight):", same)
    for mib in args.chunk_mib:
        rows.append(
            run(args.layers, True, torch.int8, args.warmup, args.steps, chunk_mib=mib, **extra)
        )
        print({k: v for k, v in rows[-1].items() if k != "digest"}, flush=True)
    for r in rows:
        r.pop("digest")
    result = dict(rows=rows, offloaded_equals_resident=same, gpu=torch.cuda.get_device_name())
    result["torch"] = torch.__version__
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
