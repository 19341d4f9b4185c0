"""Every config of the Polar Express products, pointer kernels against the persistent TMA ones.

    python bench/products_tma.py --out products_tma.json

For each shape class of the two workloads (bf16 random data; tall matrices as stored, run on
their ``.mT`` view as ``orthogonalize`` does), each config of ``GRAM_CONFIGS`` and
``POLY_APPLY_CONFIGS`` is forced and timed on the three products of an iteration:
``A = X X^T`` (``sym_gram``, K = n), ``b A + c A A`` (``sym_gram`` with y, K = m) and
``a X + B X`` (``poly_apply``), beside the same products on cuBLAS (``torch.bmm`` /
``baddbmm``). TMA configs run only where the layout allows them (``tma_layout``). Then a whole
``orthogonalize`` (the tuner's choices, TMA configs among them: ``MUON_OFFLOAD_TMA=1`` unless
set otherwise) per shape class. Times: medians of
``triton.testing.do_bench``; TFLOP/s count the full products (2 m^2 n, 2 m^3, 2 m^2 n;
5 (4 m^2 n + 2 m^3) per Polar Express). ``err``: max |config - cuBLAS| / max |cuBLAS|, a
check that each config computes the product (bf16 roundings apart). Every variant is
compiled first by ``--jobs`` processes (Triton's disk cache), so that the run stays within
a few minutes. Nothing touches the device at import (``--help`` works on any machine).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import tempfile
import time

# (workload, label, batch, rows, cols, transposed): stored matrices are rows x cols; for the
# transposed ones the iteration runs on the .mT view of a stored cols x rows matrix.
SHAPES = (
    ("qwen3", "experts gate/up 768x2048", 128, 768, 2048, False),
    ("qwen3", "experts down (.mT of 2048x768)", 128, 768, 2048, True),
    ("qwen3", "attention q/o 2048x4096", 6, 2048, 4096, False),
    ("qwen3", "attention k/v 512x2048", 12, 512, 2048, False),
    ("qwen3", "routers 128x2048", 48, 128, 2048, False),
    ("llama3", "attention q/o 4096x4096", 2, 4096, 4096, False),
    ("llama3", "attention k/v 1024x4096", 2, 1024, 4096, False),
    ("llama3", "mlp gate/up 4096x14336", 2, 4096, 14336, False),
    ("llama3", "mlp down (.mT of 14336x4096)", 2, 4096, 14336, True),
)
# One Polar Express iteration's coefficients (the third of dion's five).
A, B, C = 3.8916678022926607, -2.772484153217685, 0.5060648178503393


def _time(fn, reps_ms: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=reps_ms, return_mode="median"))


def _err(got, ref) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _rows(product, flops, ref, run, configs, tma_ok, reps_ms):
    """One row per config (skipped: TMA where the layout refuses it), and cuBLAS's."""
    rows = []
    for config in configs:
        row = {"product": product, "config": config.label(), "tma": config.tma}
        if config.tma and not tma_ok:
            continue
        try:
            out = run(config)
            row["err"] = _err(out, ref())
            row["ms"] = _time(lambda c=config: run(c), reps_ms)
            row["tflops"] = flops / row["ms"] / 1e9
        except Exception as err:  # a config that fails to compile or launch is reported
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
    return rows


def _operands(batch, rows, cols, transposed):
    """(stored, x, A, P): the stored bf16 batch, x [batch, m, n] as the iteration runs (a
    ``.mT`` view of the tall ones), A = x x^T and P = b A + c A A (cuBLAS)."""
    import torch

    torch.manual_seed(0)
    stored = torch.randn(batch, cols if transposed else rows, rows if transposed else cols)
    stored = stored.div_(stored.norm(dim=(-2, -1), keepdim=True)).to("cuda", torch.bfloat16)
    x = stored.mT if transposed else stored
    a = torch.bmm(x, x.mT)
    return stored, x, a, torch.baddbmm(a, a, a, beta=B, alpha=C)


def _launchers(x, a, p):
    """product -> (run(config) -> out, configs) on preallocated outputs."""
    import torch
    from muon_offload.kernels import gram, poly_apply

    gram_out = torch.empty_like(a)
    poly_out = torch.empty_like(a)
    apply_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)

    def run_gram(config):
        gram._launch(x, x, None, gram_out, 1.0, 0.0, 0.0, False, config)
        return gram_out

    def run_poly(config):
        gram._launch(a, a, a, poly_out, C, B, 0.0, False, config)
        return poly_out

    def run_apply(config):
        poly_apply._launch(p, x, apply_out, A, config)
        return apply_out

    return {
        "gram": (run_gram, gram.GRAM_CONFIGS),
        "poly": (run_poly, gram.GRAM_CONFIGS),
        "apply": (run_apply, poly_apply.POLY_APPLY_CONFIGS),
    }


def _compile_task(task) -> None:
    """Runs one config of one product once in a worker process: Triton compiles it into its
    on-disk cache, where the timing process then finds it (compiles run in parallel)."""
    shape_index, product, config_index = task
    stored, launchers = _worker_launchers(shape_index)
    with contextlib.suppress(Exception):  # reported by the timing process, which runs it again
        if product == "orthogonalize":  # the tuner's scratch batches specialize other variants
            from muon_offload.kernels.orthogonalize import orthogonalize

            orthogonalize(stored)
        else:
            run, configs = launchers[product]
            run(configs[config_index])


@functools.lru_cache(maxsize=1)
def _worker_launchers(shape_index: int):
    stored, x, a, p = _operands(*SHAPES[shape_index][2:])
    return stored, _launchers(x, a, p)


def _worker_init(cache_dir: str) -> None:
    # Tuning decisions made here (under the other workers' load) go to a scratch directory:
    # the timing process tunes again, from compiled kernels.
    os.environ["MUON_OFFLOAD_CACHE_DIR"] = cache_dir


def precompile(shape_indices, jobs: int) -> None:
    import multiprocessing

    from muon_offload.kernels import gram, poly_apply

    counts = {
        "gram": len(gram.GRAM_CONFIGS),
        "poly": len(gram.GRAM_CONFIGS),
        "apply": len(poly_apply.POLY_APPLY_CONFIGS),
    }
    tasks = [(i, k, c) for i in shape_indices for k, n in counts.items() for c in range(n)]
    tasks += [(i, "orthogonalize", 0) for i in shape_indices]
    with tempfile.TemporaryDirectory() as cache_dir:
        context = multiprocessing.get_context("spawn")
        with context.Pool(jobs, initializer=_worker_init, initargs=(cache_dir,)) as pool:
            for _ in pool.imap_unordered(_compile_task, tasks):
                pass


def bench_shape(workload, label, batch, rows, cols, transposed, reps_ms):
    import torch
    from muon_offload.kernels import _launch, _tma
    from muon_offload.kernels.orthogonalize import orthogonalize

    m, n = min(rows, cols), max(rows, cols)
    stored, x, a, p = _operands(batch, rows, cols, transposed)
    assert x.shape == (batch, m, n)
    launchers = _launchers(x, a, p)
    results = []
    tma_x, tma_a = _tma.tma_layout(x) is not None, _tma.tma_layout(a) is not None
    cases = (
        ("gram", 2 * m * m * n, lambda: a, *launchers["gram"], tma_x),
        ("poly", 2 * m**3, lambda: p, *launchers["poly"], tma_a),
        ("apply", 2 * m * m * n, lambda: torch.baddbmm(x, p, x, beta=A), *launchers["apply"],
         tma_x and tma_a),
    )  # fmt: skip
    cublas = {
        "gram": lambda: torch.bmm(x, x.mT),
        "poly": lambda: torch.baddbmm(a, a, a, beta=B, alpha=C),
        "apply": lambda: torch.baddbmm(x, p, x, beta=A),
    }
    for product, flops, ref, run, configs, tma_ok in cases:
        flops *= batch
        results += _rows(product, flops, ref, run, configs, tma_ok, reps_ms)
        ms = _time(cublas[product], reps_ms)
        results.append(
            {"product": product, "config": "cublas", "tma": False, "ms": ms,
             "tflops": flops / ms / 1e9}
        )  # fmt: skip
    orthogonalize(stored)  # tunes (scratch tensors) and compiles first
    ms = _time(lambda: orthogonalize(stored), reps_ms)
    flops = batch * 5 * (4 * m * m * n + 2 * m**3)
    # The tuner's latest decisions (when it tuned in this process): a hint of what ran.
    chosen = {k: _launch.TUNER.last.get(k, {}).get("config") for k in ("sym_gram", "poly_apply")}
    results.append(
        {"product": "orthogonalize", "config": "tuned", "tma": None, "ms": ms,
         "tflops": flops / ms / 1e9, "chosen": chosen}
    )  # fmt: skip
    return {
        "workload": workload,
        "label": label,
        "shape": [batch, rows, cols],
        "transposed": transposed,
        "tma_layout": {"x": tma_x, "a": tma_a},
        "results": results,
    }


def _print(entry) -> None:
    batch, rows, cols = entry["shape"]
    print(f"\n{entry['workload']} {entry['label']}: {batch} x {rows}x{cols}")
    for product in ("gram", "poly", "apply", "orthogonalize"):
        rows_ = [r for r in entry["results"] if r["product"] == product]
        timed = [r for r in rows_ if "ms" in r and r["config"] not in ("cublas", "tuned")]
        best = {
            kind: min((r for r in timed if r["tma"] is kind), key=lambda r: r["ms"], default=None)
            for kind in (False, True)
        }
        for r in rows_:
            kind = (
                "cublas"
                if r["config"] == "cublas"
                else {True: "tma", False: "ptr"}.get(r["tma"], "tuned")
            )
            mark = " *" if any(r is b for b in best.values()) else ""  # the best of its kind
            if "ms" in r:
                err = f"  err {r['err']:.1e}" if "err" in r else ""
                print(
                    f"  {product:13s} {kind:6s} {r['config']:58s} {r['ms']:8.3f} ms"
                    f" {r['tflops']:6.1f} TFLOP/s{err}{mark}"
                )
            else:
                print(f"  {product:13s} {kind:6s} {r['config']:58s} FAILED {r['error'][:80]}")
        if best[False] and best[True]:
            ratio = best[True]["ms"] / best[False]["ms"]
            print(f"  {product}: best TMA / best pointer = {ratio:.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--only", default="", help="shape labels containing this text")
    parser.add_argument("--rep-ms", type=int, default=40, help="do_bench's rep (ms)")
    parser.add_argument(
        "--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile processes"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("MUON_OFFLOAD_TMA", "1")  # on for Hopper by default; forced here

    import torch
    import triton

    started = time.perf_counter()
    chosen = [i for i, shape in enumerate(SHAPES) if args.only in shape[1]]
    if args.jobs > 1:
        precompile(chosen, args.jobs)
        print(f"compiled in {time.perf_counter() - started:.0f} s ({args.jobs} processes)")
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shapes": [],
    }
    for i in chosen:
        entry = bench_shape(*SHAPES[i], reps_ms=args.rep_ms)
        report["shapes"].append(entry)
        _print(entry)
        if args.out:  # after each shape: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
