"""Every candidate config of the orthogonalizer's products, forced, on batches of bf16 matrices:
``sym_gram`` (``X X^T``, only the tiles on and below the diagonal) and ``poly_apply``
(``a X + B X``), the kernels' own candidate lists as the tuner sees them for the shape.

    python bench/product_configs.py --out products.json
    python bench/product_configs.py --shapes 128x1024x1024 64x1024x1024 96x512x1024T

A shape is BATCHxROWSxCOLS (X is ROWS x COLS; a trailing T: X is a ``.mT`` view, as the tall
matrices' orthogonalization reads them). Times are medians of ``triton.testing.do_bench``
(CUDA events) after a warm-up launch; TFLOP/s count the full products (``2 m^2 n`` for
``X X^T``, so the symmetric kernel can pass what the card sustains, and ``2 m^2 n`` for
``B X``) so that the rows compare as speed. Each config is forced through the public
launchers (``tuning.forcing``): nothing tuned, no cache read or written. torch's ``bmm`` of
the same ``X X^T`` is the reference row.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton.testing
from muon_offload.kernels import gram, poly_apply, tuning
from muon_offload.kernels.gram import sym_gram
from muon_offload.kernels.poly_apply import poly_apply as poly_apply_
from muon_offload.kernels.shape_classes import fitting, shape_class

from muon_offload.tools.bench import machine

SHAPES = ("128x1024x1024", "64x1024x1024", "96x512x1024T")


def parse_shape(text: str) -> tuple[int, int, int, bool]:
    body = text.removesuffix("T")
    try:
        batch, rows, cols = (int(v) for v in body.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxROWSxCOLS[T], got {text!r}") from None
    if min(batch, rows, cols) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return batch, rows, cols, text.endswith("T")


def matrices(batch: int, rows: int, cols: int, transposed: bool) -> torch.Tensor:
    """bf16 [batch, rows, cols] of unit-scale rows, stored transposed when asked."""
    shape = (batch, cols, rows) if transposed else (batch, rows, cols)
    x = torch.randn(shape, device="cuda").div_(cols**0.5).to(torch.bfloat16)
    return x.mT if transposed else x


def timed(fn) -> dict:
    try:
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=5, rep=25)
    except Exception as e:  # a config the card cannot run (shared memory): say so
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    return {"ms": ms}


def forced(kernel: str, config, launch) -> dict:
    """``launch`` timed with ``kernel`` taking ``config`` (the launcher's candidates only)."""
    with tuning.forcing(kernel, config):
        return timed(launch)


def run_shape(batch: int, rows: int, cols: int, transposed: bool) -> dict:
    x = matrices(batch, rows, cols, transposed)
    a = torch.empty(batch, rows, rows, dtype=torch.bfloat16, device="cuda")
    out_a = torch.empty_like(a)
    out_x = torch.empty_like(x)
    flop = 2 * batch * rows * rows * cols / 1e12
    row = {"torch_bmm": timed(lambda: torch.bmm(x, x.mT))}
    # The launchers' classes (poly_apply's columns: a power of two, shape_class's too here).
    m_class, n_class = shape_class(rows), shape_class(cols)
    gram_configs = fitting(gram.GRAM_CONFIGS, m_class)
    with tuning.forcing("sym_gram", gram_configs[0]):
        sym_gram(x, out=a)  # a symmetric B for the apply
    kernels = (
        ("sym_gram", gram_configs, lambda: sym_gram(x, out=out_a)),
        (
            "poly_apply",
            fitting(poly_apply.POLY_APPLY_CONFIGS, m_class, n_class),
            lambda: poly_apply_(a, x, alpha=1.5, out=out_x),
        ),
    )
    for name, configs, launch in kernels:
        row[name] = {c.label(): forced(name, c, launch) for c in configs}
    for r in (row["torch_bmm"], *row["sym_gram"].values(), *row["poly_apply"].values()):
        if "ms" in r:
            r["tflops"] = flop / (r["ms"] / 1e3)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=None, help=" ".join(SHAPES))
    ap.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("product_configs.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = args.shapes or [parse_shape(s) for s in SHAPES]
    device = torch.device("cuda", torch.cuda.current_device())
    info = machine.record(device)
    info["command"] = " ".join(["bench/product_configs.py", *(argv or sys.argv[1:])])
    result = {"info": info, "shapes": {}}
    for batch, rows, cols, transposed in shapes:
        label = f"{batch}x{rows}x{cols}" + ("T" if transposed else "")
        row = result["shapes"][label] = run_shape(batch, rows, cols, transposed)
        print(f"{label}: torch bmm {row['torch_bmm'].get('ms', float('nan')):.4f} ms")
        for name in ("sym_gram", "poly_apply"):
            ranked = sorted((r["ms"], c) for c, r in row[name].items() if "ms" in r)
            for ms, c in ranked[:4]:
                print(f"  {name:10s} {ms:.4f} ms  {row[name][c]['tflops']:6.1f} TFLOP/s  {c}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
