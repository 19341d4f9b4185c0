"""Time the 8-bit state kernels against their fp32-state twins on one GPU (H200: < 1 min).

adamw_ (fp32 m, v) vs adamw8_ (int8 m, uint8 v + scales), and muon_prep (fp32 momentum) vs
muon_prep8, on 64 Mi elements (bf16 parameters and gradients; Muon: 16 matrices of
2048 x 2048), reporting median ms and GB/s counting the bytes each kernel reads plus writes.

    python bench/kernels_quantized.py --out quantized-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import triton
from muon_offload.kernels import (
    elementwise,
    muon,
    quant_maps,
    quantized_elementwise,
    quantized_muon,
)
from muon_offload.kernels._launch import bench_ms

N = 64 << 20


def _adamw_cases(n: int, dtype: torch.dtype):
    p = torch.randn(n, device="cuda", dtype=dtype)
    g = torch.randn(n, device="cuda", dtype=dtype)
    m, v = torch.randn(n, device="cuda"), torch.rand(n, device="cuda")
    mc, ms = quant_maps.quantize(torch.randn(n, device="cuda"), "adam_m")
    vc, vs = quant_maps.quantize(torch.rand(n, device="cuda"), "adam_v")
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10)
    pg = 2 * n * dtype.itemsize  # p, g read
    scales = 4 * ms.numel()
    return {
        "adamw_ fp32 state": (
            lambda: elementwise.adamw_([p], [g], [m], [v], **hyper),
            pg + n * dtype.itemsize + 2 * 8 * n,  # + p written, m, v read and written
        ),
        "adamw8_": (
            lambda: quantized_elementwise.adamw8_([p], [g], [mc], [ms], [vc], [vs], **hyper),
            pg + n * dtype.itemsize + 2 * 2 * (n + scales),
        ),
    }


def _prep_cases(n: int, dtype: torch.dtype):
    rows = cols = 2048
    batch = n // (rows * cols)
    g = [torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(batch)]
    m = [torch.randn(rows, cols, device="cuda") for _ in range(batch)]
    pairs = [quant_maps.quantize(torch.randn(rows, cols, device="cuda"), "momentum") for _ in g]
    mc, ms = [c for c, _ in pairs], [s for _, s in pairs]
    out = torch.empty(batch, rows, cols, dtype=torch.bfloat16, device="cuda")
    scales = 4 * sum(s.numel() for s in ms)
    gu = n * dtype.itemsize + 2 * n  # g read, bf16 U written
    return {
        "muon_prep fp32 momentum": (
            lambda: muon.muon_prep(m, g, mu=0.95, nesterov=True, out=out),
            gu + 8 * n,
        ),
        "muon_prep8": (
            lambda: quantized_muon.muon_prep8(mc, ms, g, mu=0.95, nesterov=True, out=out),
            gu + 2 * (n + scales),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--elements", type=int, default=N)
    args = parser.parse_args()
    results = []
    for name, (fn, nbytes) in {
        **_adamw_cases(args.elements, torch.bfloat16),
        **_prep_cases(args.elements, torch.bfloat16),
    }.items():
        fn()  # tune (scratch tensors) and compile outside the timing
        torch.cuda.synchronize()
        ms = bench_ms(fn, reps=50)
        results.append({"kernel": name, "ms": ms, "bytes": nbytes, "GB/s": nbytes / ms / 1e6})
        print(f"{name:28s} {ms:8.3f} ms {nbytes / 2**20:9.0f} MiB {nbytes / ms / 1e6:8.0f} GB/s")
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "elements": args.elements,
        "param_dtype": "bfloat16",
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
