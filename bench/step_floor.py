"""How fast a resident Muon step could be on this card: a floor from measured rates.

    python bench/step_floor.py --workload llama3-8b-fsdp8-rank --out floor.json

A resident Polar Express step (5 iterations) is matrix products plus element-wise passes. For
each Muon shape class of the workload (tall matrices in the m <= n orientation the iteration
runs in) this times the three products of an iteration on cuBLAS (``torch.bmm`` /
``torch.baddbmm``, bf16, the class's matrices in one batch; cuBLAS is the fastest bf16 GEMM
torch has here), and a bf16 8192^3 ``torch.mm`` as the card's practical peak. Floors, seconds
a step:

- ``products_cublas``: every product as cuBLAS runs it (full products: what dion's step does);
- ``products_symmetric``: the same, with the two symmetric products (A = X X^T, b A + c A A)
  charged only for the tiles on and below the diagonal (T (T + 1) / 2 of T^2, 128-row tiles),
  at cuBLAS's rate for the shape: what our kernels compute;
- ``products_at_peak``: the symmetric FLOPs at the 8192^3 rate;
- ``elementwise``: the bytes the element-wise passes must move (Muon: gradient, momentum read
  and written, the bf16 update written, read by the normalization and written, read by the
  apply with the parameter read and written: 28 bytes an element; AdamW: 28 bytes an element)
  at the measured device copy bandwidth (bytes read + written).

``floor_*`` adds ``elementwise`` to each. With ``--dion-step S`` (dion's measured eager step,
seconds) it prints each floor as a ratio to it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from muon_offload.tools.bench import machine
from muon_offload.tools.workloads import WORKLOADS, workload

POLAR_EXPRESS_ITERS = 5
TILE = 128
MUON_BYTES_PER_ELEMENT = 28  # grad 4 + momentum 8 + bf16 2 + normalize 4 + apply 2 + param 8
ADAMW_BYTES_PER_ELEMENT = 28  # grad 4 + param 8 + two moments 16


def _ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def _peak_flops(dev: torch.device) -> float:
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    return 2 * 8192**3 / (_ms(lambda: a @ a) * 1e-3)


def _copy_bandwidth(dev: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device copy."""
    big = torch.empty(1 << 28, device=dev)
    return 2 * big.numel() * 4 / (_ms(big.clone) * 1e-3)


def _product_seconds(batch: int, m: int, n: int, dev: torch.device) -> tuple[float, ...]:
    """Seconds per matrix of A = X X^T, b A + c A A and a X + B X on cuBLAS, bf16."""
    x = torch.randn(batch, m, n, device=dev, dtype=torch.bfloat16) / math.sqrt(n)
    gram = torch.bmm(x, x.mT)
    return tuple(
        _ms(fn) * 1e-3 / batch
        for fn in (
            lambda: torch.bmm(x, x.mT),
            lambda: torch.baddbmm(gram, gram, gram, beta=2.0, alpha=-1.0),
            lambda: torch.baddbmm(x, gram, x, beta=3.0),
        )
    )


def shape_classes(specs) -> dict[tuple[int, int], int]:
    """(m, n) with m <= n -> how many Muon matrices of the workload have it."""
    classes: dict[tuple[int, int], int] = {}
    for s in specs:
        if s.algorithm == "muon":
            m, n = sorted(s.shape[-2:])
            count = math.prod(s.shape[:-2])
            classes[(m, n)] = classes.get((m, n), 0) + count
    return classes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="llama3-8b-fsdp8-rank", choices=sorted(WORKLOADS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dion-step", type=float, default=None, help="dion's eager step, seconds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dev = torch.device("cuda")
    specs = workload(args.workload, args.layers)
    peak, copy_bw = _peak_flops(dev), _copy_bandwidth(dev)

    rows = []
    totals = {"products_cublas": 0.0, "products_symmetric": 0.0, "products_at_peak": 0.0}
    for (m, n), count in sorted(shape_classes(specs).items()):
        batch = max(1, min(count, (1 << 31) // (m * n * 2)))  # at most 2 GiB of X
        t_gram, t_poly, t_apply = _product_seconds(batch, m, n, dev)
        tiles = -(-m // TILE)
        sym = (tiles + 1) / (2 * tiles)
        flops_sym = (2 * m * m * n + 2 * m**3) * sym + 2 * m * m * n
        per_iter_cublas = t_gram + t_poly + t_apply
        per_iter_sym = (t_gram + t_poly) * sym + t_apply
        it = POLAR_EXPRESS_ITERS * count
        totals["products_cublas"] += it * per_iter_cublas
        totals["products_symmetric"] += it * per_iter_sym
        totals["products_at_peak"] += it * flops_sym / peak
        rows.append(
            {
                "m": m,
                "n": n,
                "count": count,
                "batch_timed": batch,
                "tflops_gram": 2 * m * m * n / t_gram / 1e12,
                "tflops_poly": 2 * m**3 / t_poly / 1e12,
                "tflops_apply": 2 * m * m * n / t_apply / 1e12,
                "step_s_cublas": it * per_iter_cublas,
                "step_s_symmetric": it * per_iter_sym,
            }
        )
    muon = sum(s.numel for s in specs if s.algorithm == "muon")
    adamw = sum(s.numel for s in specs if s.algorithm != "muon")
    totals["elementwise"] = (
        muon * MUON_BYTES_PER_ELEMENT + adamw * ADAMW_BYTES_PER_ELEMENT
    ) / copy_bw
    for k in ("products_cublas", "products_symmetric", "products_at_peak"):
        totals["floor_" + k.removeprefix("products_")] = totals[k] + totals["elementwise"]
    result = {
        "info": machine.record(dev, args),
        "peak_bf16_tflops": peak / 1e12,
        "copy_tb_s": copy_bw / 1e12,
        "classes": rows,
        "seconds": totals,
    }
    if args.dion_step:
        result["ratio_to_dion"] = {k: v / args.dion_step for k, v in totals.items()}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"bf16 8192^3: {peak / 1e12:.0f} TFLOP/s; device copy {copy_bw / 1e12:.2f} TB/s")
    for r in rows:
        print(
            f"{r['count']:4d} x {r['m']}x{r['n']}: cuBLAS gram {r['tflops_gram']:.0f}, poly "
            f"{r['tflops_poly']:.0f}, apply {r['tflops_apply']:.0f} TFLOP/s; step share "
            f"{r['step_s_cublas'] * 1e3:.1f} ms full, {r['step_s_symmetric'] * 1e3:.1f} symmetric"
        )
    for k, v in totals.items():
        ratio = f" = {v / args.dion_step:.3f} x dion" if args.dion_step else ""
        print(f"{k:<20} {v * 1e3:8.1f} ms{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
