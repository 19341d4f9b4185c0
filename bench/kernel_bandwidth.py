"""Kernel benchmark: achieved bandwidth of the fused kernels against the device-memory copy.

    python bench/kernel_bandwidth.py --out kernels.json

Bandwidth counts the fewest bytes each kernel must move (every input read once, every output
written once) over the median time (CUDA events, ``triton.testing.do_bench``) on fresh random
data. Each figure is also given as a ratio to the device-to-device copy bandwidth measured in
the same run, with the config the tuner chose. Also: torch's ``_fused_adamw_``, the eager prep
dion runs, and Polar Express on the batched cuBLAS product.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import torch
import triton
import triton.testing
from muon_offload.kernels import tuning
from muon_offload.kernels.elementwise import adamw_
from muon_offload.kernels.muon import muon_apply_, muon_prep
from muon_offload.kernels.orthogonalize import orthogonalize

MIB = 1 << 20
ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def ms_of(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def rand(shape, dtype=torch.float32, positive=False):
    x = torch.randn(shape, device="cuda")
    return (x.abs_().add_(1e-3) if positive else x).to(dtype)


def chosen(kernel: str) -> str | None:
    """The config label the tuner's last choice for ``kernel`` gave, if any."""
    choice = tuning.last_choice(kernel)
    return choice[0] if choice else None


def bench_copy(add):
    """Device-memory copy: 1 GiB each way, bytes read + written."""
    src, dst = rand(256 * MIB), torch.empty(256 * MIB, device="cuda")
    add("copy 1 GiB (read + write)", ms_of(lambda: dst.copy_(src)), 2 * src.numel() * 4)


def bench_adamw(add, rows, state_mib):
    """AdamW on ``state_mib`` of fp32 state (m + v: 8 bytes an element)."""
    dev = torch.device("cuda")
    n = state_mib * MIB // 8
    p, g, m, v = rand(n), rand(n), rand(n), rand(n, positive=True)
    adamw_([p], [g], [m], [v], **ADAMW, step=1)  # tunes (scratch copies) and compiles
    add(
        "adamw_ fp32, 1 segment (pointer table)",
        ms_of(lambda: adamw_([p], [g], [m], [v], **ADAMW, step=3)),
        28 * n,
        config=chosen("adamw"),
    )
    try:
        steps = [torch.tensor(3.0, device=dev)]
        fused = lambda: torch._fused_adamw_(
            [p],
            [g],
            [m],
            [v],
            [],
            steps,
            lr=1e-3,
            beta1=0.9,
            beta2=0.95,
            weight_decay=0.1,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )
        add("torch._fused_adamw_ fp32", ms_of(fused), 28 * n)
    except Exception as exc:  # noqa: BLE001 - an anchor that fails is reported, not fatal
        print(f"  torch._fused_adamw_ failed: {exc!r}")

    # The same elements as 98 + N segments of mixed sizes (norm vectors, odd sizes).
    sizes = [2048] * 96 + [1, 7, 12345]
    rest = n - sum(sizes)
    sizes += [rest // 5] * 4 + [rest - 4 * (rest // 5)]
    segs = [list(t.split(sizes)) for t in (p, g, m, v)]
    adamw_(*segs, **ADAMW, step=1)
    add(
        f"adamw_ fp32, {len(sizes)} segments (pointer table)",
        ms_of(lambda: adamw_(*segs, **ADAMW, step=3)),
        28 * n,
    )
    try:  # GPU time alone: the same call captured in a CUDA graph (no host launch cost)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            adamw_(*segs, **ADAMW, step=3)
        add(f"adamw_ fp32, {len(sizes)} segments, CUDA graph replay", ms_of(graph.replay), 28 * n)
    except Exception as exc:  # noqa: BLE001
        print(f"  graph capture failed: {exc!r}")
    # Host cost of one call (its pointer table cached after the first).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        adamw_(*segs, **ADAMW, step=3)
    host_us = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    rows.append(
        {"name": "adamw_ host time per call", "segments": len(sizes), "us_table_cached": host_us}
    )
    print(f"  adamw_ host time per call, {len(sizes)} segments: {host_us:.0f} us")


def bench_adamw_bf16(add, state_mib):
    # bf16 state (and grads): 256 MiB of state is twice the elements.
    n2 = state_mib * MIB // 4
    p, g = rand(n2), rand(n2, torch.bfloat16)
    m, v = rand(n2, torch.bfloat16), rand(n2, torch.bfloat16, positive=True)
    adamw_([p], [g], [m], [v], **ADAMW, step=1)
    add(
        "adamw_ fp32 param, bf16 grad + state",
        ms_of(lambda: adamw_([p], [g], [m], [v], **ADAMW, step=3)),
        n2 * (8 + 2 + 8),
    )


def bench_muon(add, rows, batch, shape):
    """Muon prep (fp32 momentum and grads; U bf16 + sums of squares) and apply."""
    dev = torch.device("cuda")
    numel = shape[0] * shape[1]
    mom = [rand(shape) for _ in range(batch)]
    grads = [rand(shape) for _ in range(batch)]
    out = torch.empty(batch, *shape, dtype=torch.bfloat16, device=dev)
    sumsq = torch.empty(batch, device=dev)
    muon_prep(mom, grads, mu=0.95, nesterov=True, out=out, sumsq=sumsq)
    nbytes = batch * numel * 14  # M read + write, G read, U write
    state = f"{batch * numel * 4 / MIB:.0f} MiB state"
    add(
        f"muon_prep {batch} x {shape[0]}x{shape[1]} ({state})",
        ms_of(lambda: muon_prep(mom, grads, mu=0.95, nesterov=True, out=out, sumsq=sumsq)),
        nbytes,
        config=chosen("muon_prep"),
    )

    def eager():  # dion's muon_update_pre_orthogonalize body, run eagerly
        torch._foreach_mul_(mom, 0.95)
        torch._foreach_add_(mom, grads)
        u = torch._foreach_mul(mom, 0.95)
        torch._foreach_add_(u, grads)
        return [x.to(dtype=torch.bfloat16) for x in u]

    add(f"eager prep (dion) {batch} x {shape[0]}x{shape[1]}", ms_of(eager), nbytes)

    params = [rand(shape) for _ in range(batch)]
    muon_apply_(params, out, lr=0.02, weight_decay=0.1, adjusted_lr=0.02)
    add(
        f"muon_apply_ {batch} x {shape[0]}x{shape[1]} fp32 X, bf16 U",
        ms_of(lambda: muon_apply_(params, out, lr=0.02, weight_decay=0.1, adjusted_lr=0.02)),
        batch * numel * 10,
    )
    ut = out.mT.contiguous().mT  # what orthogonalize returns for a tall matrix
    muon_apply_(params, ut, lr=0.02, weight_decay=0.1, adjusted_lr=0.02)
    add(
        f"muon_apply_ {batch} x {shape[0]}x{shape[1]} fp32 X, bf16 U transposed view",
        ms_of(lambda: muon_apply_(params, ut, lr=0.02, weight_decay=0.1, adjusted_lr=0.02)),
        batch * numel * 10,
    )
    if batch == 256:
        x = out.mT.contiguous()  # [256, 768, 2048]: the wide orientation
        flop = 5 * (4 * 768 * 768 * 2048 + 2 * 768**3) * batch
        ms = ms_of(lambda: orthogonalize(x, sumsq))
        rows.append(
            {
                "name": "polar express 5 it, 256 x 768x2048 bf16 (torch bmm)",
                "ms": ms,
                "TFLOPs": flop / ms / 1e9,
            }
        )
        print(f"  {rows[-1]['name']:<58} {ms:9.4f} ms {flop / ms / 1e9:8.0f} TFLOP/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--state-mib", type=int, default=256)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    info = {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows: list[dict] = []

    def add(name, ms, nbytes, **extra):
        rows.append({"name": name, "ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6, **extra})
        r = rows[-1]
        print(f"  {name:<58} {ms:9.4f} ms {r['GBps']:8.0f} GB/s", flush=True)

    bench_copy(add)
    copy_bw = rows[-1]["GBps"]
    bench_adamw(add, rows, args.state_mib)
    bench_adamw_bf16(add, args.state_mib)
    for batch, shape in (
        (args.state_mib * MIB // (4 * 2048 * 768), (2048, 768)),
        (256, (2048, 768)),
    ):
        bench_muon(add, rows, batch, shape)

    # Ratios to the copy bandwidth.
    for r in rows:
        if "GBps" in r:
            r["ratio_to_copy"] = r["GBps"] / copy_bw
    result = {"info": info, "copy_GBps": copy_bw, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    print(f"\n{info['gpu']} | torch {info['torch']} | triton {info['triton']} | {info['date']}")
    print(f"{'kernel':<66} {'ms':>9} {'GB/s':>7} {'x copy':>7}")
    for r in rows:
        if "GBps" in r:
            print(f"{r['name']:<66} {r['ms']:9.4f} {r['GBps']:7.0f} {r['ratio_to_copy']:7.2f}")
        elif "TFLOPs" in r:
            print(f"{r['name']:<66} {r['ms']:9.4f} {r['TFLOPs']:5.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
