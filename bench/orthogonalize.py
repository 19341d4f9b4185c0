"""Orthogonalization benchmark: the products of a Polar Express iteration on batched cuBLAS
against the Triton kernels (``kernels/gram.py``: the symmetric ones, only the tiles on and
below the diagonal; ``kernels/poly_apply.py``: ``a X + B X``).

    python bench/orthogonalize.py --out ortho.json

For each batch of bf16 matrices (the bench workload's shape classes, tall ones in the
orientation the iteration runs in): ``A = X X^T`` (``torch.bmm`` vs ``sym_gram``),
``b A + c A A`` (``torch.baddbmm`` vs ``sym_gram`` with y), ``a X + B X`` (``torch.baddbmm``
vs ``poly_apply``; X in the stored layout, so a ``.mT`` view for the tall ones), and a whole
5-iteration Polar Express on each path of ``orthogonalize_on`` (every name of ``PRODUCTS``,
and ``auto``, what ``orthogonalize`` runs). Times are medians of ``triton.testing.do_bench``
(CUDA events, after tuning and warm-up); TFLOP/s count the full products (2 m^2 n, 2 m^3,
2 m^2 n; 5 (4 m^2 n + 2 m^3) per Polar Express) for every path, so they compare directly as
speed. The config the tuner chose for each Triton product goes into the JSON. Accuracy:
relative RMS difference between the paths, and of each against float64.

``--section methods`` times whole orthogonalizations instead, on the workloads' shapes (qwen3
and llama3-8b, tall ones as stored): Polar Express (Triton, what ``orthogonalize`` runs; and
on cuBLAS), Gram Newton-Schulz (ours on Triton; ours on cuBLAS) and the ``gram-newton-schulz``
package as dion configures it (when importable; its CuTeDSL kernels when quack is importable,
eager unless ``--package-compile``), each with its error against float64 on two matrices.
``--section step`` times the resident step of the qwen3 workload (48 layers, fp32 state),
interleaved rounds, with today's products path and with the previous, batch-dependent one
(cuBLAS below 16 x 768^2 x 2048 of work or 768 rows), for both orthogonalizers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch
import triton
import triton.testing
from muon_offload.kernels import orthogonalize as ortho_module
from muon_offload.kernels import tuning
from muon_offload.kernels.gram import sym_gram
from muon_offload.kernels.gram_newton_schulz import GRAM_NS_COEFFS
from muon_offload.kernels.orthogonalize import (
    POLAR_EXPRESS_COEFFS,
    POLAR_EXPRESS_NORM_SCALE,
    PRODUCTS,
    orthogonalize,
    orthogonalize_on,
    products_for,
)
from muon_offload.kernels.poly_apply import poly_apply

# (label, batch, rows, cols, transposed): the stored matrices are rows x cols; transposed
# ones are the tall experts' down projections, run on their .mT view as orthogonalize does.
SHAPES = (
    ("experts gate/up, 128", 128, 768, 2048, False),
    ("experts gate/up, 16", 16, 768, 2048, False),
    ("experts down (2048x768 on .mT), 128", 128, 768, 2048, True),
    ("attention q/o (2048x4096)", 6, 2048, 4096, False),
    ("attention k/v (512x2048)", 12, 512, 2048, False),
    ("routers (128x2048)", 48, 128, 2048, False),
)


def ms_of(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def polar64(u: torch.Tensor) -> torch.Tensor:
    x = u.double()
    x = x / (torch.linalg.matrix_norm(x)[:, None, None] * POLAR_EXPRESS_NORM_SCALE + 1e-8)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def batch_of(batch, rows, cols, transposed):
    if transposed:  # stored [cols, rows] contiguous, used as its [rows, cols] transpose
        return torch.randn(batch, cols, rows, device="cuda").to(torch.bfloat16).mT
    return torch.randn(batch, rows, cols, device="cuda").to(torch.bfloat16)


def chosen(kernel: str) -> str | None:
    """The config label the tuner's last choice for ``kernel`` gave, if any."""
    choice = tuning.last_choice(kernel)
    return choice[0] if choice else None


def bench_shape(label, batch, m, n, transposed, add, rows_out, rounds) -> None:
    u = batch_of(batch, m, n, transposed)
    x = (u.float() / u.float().norm(dim=(1, 2), keepdim=True)).to(torch.bfloat16)
    x = x.mT.contiguous().mT if transposed else x
    gram = torch.bmm(x, x.mT)
    out = torch.empty_like(gram)
    a, b, c = POLAR_EXPRESS_COEFFS[2]
    flop_gram, flop_poly = 2 * batch * m * m * n, 2 * batch * m**3
    flop_pe = 5 * batch * (4 * m * m * n + 2 * m**3)

    sym_gram(x, out=out)  # tunes, compiles
    cfg_gram = chosen("sym_gram")
    add(label, "X X^T", "cublas", ms_of(lambda: torch.bmm(x, x.mT, out=out)), flop_gram)
    add(
        label,
        "X X^T",
        "triton",
        ms_of(lambda: sym_gram(x, out=out)),
        flop_gram,
        config=cfg_gram,
    )
    sym_gram(gram, alpha=c, y=gram, beta=b, out=out)
    cfg_poly = chosen("sym_gram")
    add(
        label,
        "bA + cAA",
        "cublas",
        ms_of(lambda: torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=out)),
        flop_poly,
    )
    add(
        label,
        "bA + cAA",
        "triton",
        ms_of(lambda: sym_gram(gram, alpha=c, y=gram, beta=b, out=out)),
        flop_poly,
        config=cfg_poly,
    )
    poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    y_cub = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    y_tri = poly_apply(poly, x, alpha=a)  # tunes, compiles
    cfg_apply = chosen("poly_apply")
    add(
        label,
        "aX + BX",
        "cublas",
        ms_of(lambda: torch.baddbmm(x, poly, x, beta=a, alpha=1.0, out=y)),
        flop_gram,
    )
    add(
        label,
        "aX + BX",
        "triton",
        ms_of(lambda: poly_apply(poly, x, alpha=a, out=y)),
        flop_gram,
        config=cfg_apply,
    )
    k = min(batch, 4)
    y64 = a * x[:k].double() + poly[:k].double() @ x[:k].double()
    res = {path: orthogonalize_on(u, products=path) for path in (*PRODUCTS, "auto")}
    for r in range(rounds):  # rounds interleave the paths: clock drift shows as spread
        for path in (*PRODUCTS, "auto"):
            ms = ms_of(lambda p=path: orthogonalize_on(u, products=p))
            add(label, "polar express", path, ms, flop_pe, round=r)
    ref = polar64(u[:k])
    acc = {
        "aX+BX_triton_vs_cublas": rel(y_tri, y_cub),
        "aX+BX_triton_vs_f64": rel(y_tri[:k], y64),
        "aX+BX_cublas_vs_f64": rel(y_cub[:k], y64),
        **{f"{p}_vs_cublas": rel(res[p], res["cublas"]) for p in PRODUCTS if p != "cublas"},
        **{f"{p}_vs_f64": rel(res[p][:k], ref) for p in ("cublas", "triton", "triton_all")},
    }
    rows_out.append({"shape": label, "op": "accuracy (rel. RMS)", **acc})
    print(f"{label:<38} accuracy: " + ", ".join(f"{k} {v:.4f}" for k, v in acc.items()))
    print(f"{'':<38} auto -> {products_for(x)}")


# (label, batch, rows, cols, transposed view): stored rows x cols; with the flag, a .mT view of
# a contiguous [batch, cols, rows] (the experts' down projections as the collectives hand them).
METHOD_SHAPES = (
    ("qwen3 768x2048", 16, 768, 2048, False),
    ("qwen3 768x2048", 128, 768, 2048, False),
    ("qwen3 768x2048 .mT", 16, 768, 2048, True),
    ("qwen3 768x2048 .mT", 128, 768, 2048, True),
    ("qwen3 2048x768", 128, 2048, 768, False),
    ("qwen3 128x2048", 48, 128, 2048, False),
    ("qwen3 512x2048", 12, 512, 2048, False),
    ("qwen3 4096x2048", 6, 4096, 2048, False),
    ("qwen3 2048x4096", 6, 2048, 4096, False),
    ("llama3 4096x4096", 8, 4096, 4096, False),
    ("llama3 1024x4096", 8, 1024, 4096, False),
    ("llama3 14336x4096", 2, 14336, 4096, False),
    ("llama3 4096x14336", 2, 4096, 14336, False),
)


def gns64(u: torch.Tensor) -> torch.Tensor:
    """What Gram Newton-Schulz computes, on X itself in float64 (norm + 1e-7, wide side)."""
    x = u.double()
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    x = x / (torch.linalg.matrix_norm(x)[:, None, None] + 1e-7)
    for a, b, c in GRAM_NS_COEFFS:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def polar64_any(u: torch.Tensor) -> torch.Tensor:
    tall = u.size(-2) > u.size(-1)
    out = polar64(u.mT if tall else u)
    return out.mT if tall else out


def package_orthogonalizer(compile_it: bool):
    """dion's configuration of the package (megabatch_base.py), or None where missing."""
    try:
        from gram_newton_schulz import GramNewtonSchulz
    except ImportError:
        return None, "gram_newton_schulz not importable"
    try:
        import quack.gemm_interface  # noqa: F401

        kernels = True
    except Exception:
        kernels = False
    compile_kwargs = dict(fullgraph=True, mode="default") if compile_it else None
    gns = GramNewtonSchulz(
        ns_use_kernels=kernels,
        use_gram_newton_schulz=True,
        gram_newton_schulz_reset_iterations=[2],
        compile_kwargs=compile_kwargs,
    )
    return gns, f"kernels={kernels} compiled={compile_it}"


def bench_methods(args, add, rows_out, save) -> None:
    package, note = package_orthogonalizer(args.package_compile)
    rows_out.append({"op": "package", "note": note})
    print(f"package: {note}")
    paths = {
        "polar_express triton": lambda u: orthogonalize(u),
        "polar_express cublas": lambda u: orthogonalize_on(u, products="cublas"),
        "gram_ns triton": lambda u: orthogonalize(u, method="gram_newton_schulz"),
        "gram_ns cublas": lambda u: orthogonalize_on(
            u, method="gram_newton_schulz", products="cublas"
        ),
    }
    if package is not None:
        paths["gram_ns package"] = package
    for label, batch, rows, cols, transposed in METHOD_SHAPES:
        if args.only not in label:
            continue
        u = batch_of(batch, rows, cols, transposed)
        m, n = min(rows, cols), max(rows, cols)
        flop_pe = 5 * batch * (4 * m * m * n + 2 * m**3)
        name = f"{batch} x {label}"
        k = min(batch, 2)
        refs = {"polar_express": polar64_any(u[:k]), "gram_ns": gns64(u[:k])}
        for path, fn in paths.items():
            try:
                out = fn(u)  # tunes, compiles
                ms = ms_of(lambda fn=fn, u=u: fn(u))
            except Exception as e:  # a path that cannot run here is reported, not fatal
                rows_out.append({"shape": name, "path": path, "error": repr(e)[:300]})
                print(f"{name:<30} {path:<22} error: {e!r}"[:200], flush=True)
                continue
            err = rel(out[:k], refs[path.split()[0]])
            add(name, "orthogonalize", path, ms, flop_pe, err_vs_f64=err)
            print(f"{'':<30} {path:<22} rel. RMS vs float64 {err:.4f}", flush=True)
        del u
        torch.cuda.empty_cache()
        save()


def _old_products_for(x: torch.Tensor) -> str:
    """The rule before the batch stopped choosing: Triton from 768 rows and 16 x 768^2 x 2048
    of work, else cuBLAS."""
    batch, m, n = x.shape
    if x.dtype == torch.bfloat16 and m >= 768 and batch * m * m * n >= 16 * 768 * 768 * 2048:
        return "triton_all"
    return "cublas"


def bench_step(args, rows_out) -> None:
    from muon_offload import Muon
    from muon_offload.tools.bench.modes import build
    from muon_offload.tools.workloads import qwen3_30b_a3b_ep8_rank

    groups, _, _ = build(qwen3_30b_a3b_ep8_rank(args.layers), torch.device("cuda"))
    new_rule = ortho_module.products_for
    for method in ("polar_express", "gram_newton_schulz"):
        opt = Muon(groups, lr=0.01, orthogonalizer=method)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = {"today": [], "batch-dependent products": []}
        for rule in (new_rule, _old_products_for):  # warm-up: tuning, compiling
            ortho_module.products_for = rule
            for _ in range(2):
                opt.step()
        for _ in range(args.step_rounds):  # interleaved: clock drift lands on both
            for label, rule in zip(times, (new_rule, _old_products_for), strict=True):
                ortho_module.products_for = rule
                torch.cuda.synchronize()
                start.record()
                opt.step()
                end.record()
                end.synchronize()
                times[label].append(start.elapsed_time(end) / 1e3)
        ortho_module.products_for = new_rule
        for label, ts in times.items():
            med = sorted(ts)[len(ts) // 2]
            row = {"op": "resident step", "method": method, "products": label, "median_s": med}
            rows_out.append({**row, "all_s": ts, "layers": args.layers})
            print(f"resident step {method:<20} {label:<26} median {med:.4f} s", flush=True)
        del opt
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="orthogonalize.json")
    parser.add_argument("--only", default="", help="run the shapes whose label contains this")
    parser.add_argument("--rounds", type=int, default=1, help="Polar Express timing rounds")
    parser.add_argument(
        "--section",
        nargs="+",
        default=["products"],
        choices=["products", "methods", "step"],
        help="products: each product, every path; methods: whole orthogonalizers on the "
        "workloads' shapes; step: the resident step, today's products path vs the old one",
    )
    parser.add_argument("--package-compile", action="store_true", help="torch.compile it")
    parser.add_argument("--layers", type=int, default=48, help="qwen3 layers for --section step")
    parser.add_argument("--step-rounds", type=int, default=9)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows_out = []

    def add(shape, op, path, ms, flop, **extra):
        row = {"shape": shape, "op": op, "path": path, "ms": ms, "TFLOP/s": flop / ms / 1e9}
        row.update(extra)
        rows_out.append(row)
        print(f"{shape:<38} {op:<14} {path:<11} {ms:>9.3f} {row['TFLOP/s']:>9.0f}", flush=True)

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": "triton.testing.do_bench median, warmup 25 ms, rep 100 ms",
    }
    print(json.dumps(meta))

    def save() -> None:  # after every part: a run cut short keeps its rows
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows_out}, f, indent=1)

    if "products" in args.section:
        print(f"{'shape':<38} {'op':<14} {'path':<11} {'ms':>9} {'TFLOP/s':>9}")
        for label, batch, m, n, transposed in SHAPES:
            if args.only not in label:
                continue
            bench_shape(label, batch, m, n, transposed, add, rows_out, args.rounds)
            torch.cuda.empty_cache()
            save()
    if "methods" in args.section:
        bench_methods(args, add, rows_out, save)
    if "step" in args.section:
        bench_step(args, rows_out)
        save()


if __name__ == "__main__":
    main()
