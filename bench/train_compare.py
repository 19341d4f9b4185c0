"""The training comparison: does 8-bit optimizer state train as well as fp32 (and Gram
Newton-Schulz as well as Polar Express)? A byte-level GPT (bench/train_compare_model.py) on the
Python standard library's own source, trained once per mode with the same seed and the same data
order:

    muon_fp32, muon_bf16, muon_int8, muon_gram_fp32   Muon for the matrices, AdamW for the rest
    adamw_fp32, adamw_bf16, adamw_int8                muon_offload.AdamW for everything

all with ``offload=True`` on a GPU. A mode whose optimizer cannot be built (a feature that has
not landed) is recorded as skipped with the error; the others still run.

    python bench/train_compare.py --out out/train --time-limit 500   # one H200
    python bench/train_compare.py --tiny --out out/tiny                # CPU, < 1 min

Writes ``train_compare.json`` into ``--out`` after every mode (a run cut short keeps what
finished), then ``train_compare.png`` (smoothed loss curves: Muon runs, AdamW runs) and prints
a table: each mode's final loss (mean of the last ``--final-window`` training losses) and its
ratio to the fp32 mode of the same optimizer (the target: 8-bit within 1% of fp32).

The defaults are sized for one H200: a 54.7 M-parameter model (dim 640, 11 layers, untied
head) at 24 x 512 tokens a step is 6 * 54.7e6 * 12288 = 4.0 TFLOP. Measured (2026-12-01):
Muon with offloaded fp32 state alone on the card, 39 ms a step; five modes side by side, one
process each, 110-117 ms a step and 231-262 s a mode (the card shared five ways). The
comparison needs losses, not times, so run modes side by side and merge their records:

    for m in adamw_fp32 adamw_int8; do
        python bench/train_compare.py --modes $m --out out/$m &
    done; wait
    python bench/train_compare.py --merge out/adamw_fp32 out/adamw_int8 --out out/train

After each mode a run prints how long the rest will take at that pace; ``--time-limit`` skips
the modes that would not fit.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
import traceback
from pathlib import Path

import torch

from muon_offload.tools import options
from muon_offload.tools.bench import machine

# isort: split
# Siblings in bench/, imported by plain name (the script's folder is on sys.path).
from train_compare_model import GPT, loss_of, stdlib_corpus, window_starts, windows
from train_compare_modes import (
    DEFAULT_MODES,
    FULL,
    HYPER,
    MODES,
    TINY,
    Mode,
    build_optimizer,
    describe,
    lr_factor,
)
from train_compare_report import figure, table


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: GPT, val: torch.Tensor, val_starts: torch.Tensor, a) -> float:
    model.eval()
    total = sum(loss_of(model, windows(val, s, a.seq), a.autocast) for s in val_starts)
    model.train()
    return float(total) / len(val_starts)


def run_mode(mode: Mode, a, data: dict) -> dict:
    """Train one mode from the seeded init; the record of its losses, times and memory."""
    device = a.device
    rec = describe(mode)
    torch.manual_seed(a.seed)
    model = GPT(a.dim, a.layers, a.heads, a.seq).to(device)
    try:
        opt = build_optimizer(mode, model, a.offload)
    except Exception as e:  # a mode that has not landed yet: the others still run
        return {**rec, "status": "skipped", "error": f"{type(e).__name__}: {e}"}
    base_lrs = [g["lr"] for g in opt.param_groups]
    losses = torch.full((a.steps,), math.nan, device=device)
    loss_list: list[float] = []
    val_curve: list[tuple[int, float]] = []
    blocks: list[tuple[int, float]] = []  # (steps, seconds), synchronized at both ends
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    status, error, start, step = "ok", None, time.perf_counter(), 0
    try:
        while step < a.steps:
            # Step 1 alone (pinning, kernel compilation), then blocks without a host sync,
            # up to the next multiple of log_every or eval_every.
            end = min(a.steps, *(step // n * n + n for n in (a.log_every, a.eval_every)))
            end = 1 if step == 0 else end
            sync(device)
            t0 = time.perf_counter()
            for s in range(step, end):
                for g, lr in zip(opt.param_groups, base_lrs, strict=True):
                    g["lr"] = lr * lr_factor(s, a.steps)
                loss = loss_of(model, windows(data["train"], data["starts"][s], a.seq), a.autocast)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), HYPER["clip"])
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[s] = loss.detach()
            sync(device)
            blocks.append((end - step, time.perf_counter() - t0))
            new = losses[step:end].tolist()
            loss_list += new
            step = end
            if not all(math.isfinite(x) for x in new):
                status = "diverged"
                break
            if step % a.eval_every == 0 or step == a.steps:
                val_curve.append((step, evaluate(model, data["val"], data["val_starts"], a)))
                ms = _ms(blocks) or 1e3 * blocks[0][1]  # only step 1 so far: its time
                print(
                    f"  {mode.name} step {step:>5}: train {loss_list[-1]:.4f} "
                    f"val {val_curve[-1][1]:.4f}  {ms:.1f} ms/step",
                    flush=True,
                )
    except Exception as e:
        # Refused at the first step (a format whose kernels have not landed): skipped, as at
        # construction; anything later is a failure, and its losses so far are kept.
        not_started = isinstance(e, NotImplementedError) and not loss_list
        status = "skipped" if not_started else "failed"
        error = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()[-3000:]
    window = loss_list[-a.final_window :]
    rec.update(
        status=status,
        error=error,
        steps_done=len(loss_list),
        final=sum(window) / len(window) if status == "ok" else None,
        final_val=val_curve[-1][1] if status == "ok" and val_curve else None,
        losses=loss_list,
        val=val_curve,
        first_step_s=blocks[0][1] if blocks else None,
        step_ms_median=_ms(blocks),
        step_ms_blocks=[1e3 * t / n for n, t in blocks[1:]],
        wall_s=time.perf_counter() - start,
        peak_gpu_mib=torch.cuda.max_memory_allocated(device) / 2**20
        if device.type == "cuda"
        else None,
    )
    del model, opt, losses
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def _ms(blocks: list[tuple[int, float]]) -> float | None:
    """Median ms per step over the blocks after the first step (which compiles and pins)."""
    per_step = sorted(1e3 * t / n for n, t in blocks[1:])
    return per_step[len(per_step) // 2] if per_step else None


def parser() -> argparse.ArgumentParser:
    ap = options.parser("bench/train_compare.py", __doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a small model on a few steps (CPU, CI)")
    for key in FULL:
        ap.add_argument(
            f"--{key.replace('_', '-')}",
            type=int,
            default=None,
            help=f"default {FULL[key]}, {TINY[key]} with --tiny",
        )
    ap.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, run in this order; of {', '.join(MODES)}",
    )
    ap.add_argument("--seed", type=int, default=0, help="init and data order, for every mode")
    ap.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="seconds: a mode that would end past it (judged by the longest mode so far) is "
        "skipped, so the run still ends with its table and figure; 0: no limit",
    )
    ap.add_argument("--out", type=Path, default=Path("out/train_compare"), help="output folder")
    ap.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="RUN",
        help="train nothing: merge earlier runs' train_compare.json (folders or files; e.g. one "
        "process a mode, run side by side) into one JSON, figure and table in --out",
    )
    ap.add_argument(
        "--device",
        type=options.torch_device,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda where a GPU is available)",
    )
    return ap


def parse(argv: list[str] | None):
    ap = parser()
    a = ap.parse_args(argv)
    for key, value in (TINY if a.tiny else FULL).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
        if getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    if a.dim % a.heads:
        ap.error(f"--dim {a.dim} is not a multiple of --heads {a.heads}")
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in a.modes if m not in MODES]
    if unknown or not a.modes:
        ap.error(f"unknown modes {unknown}; expected some of {', '.join(MODES)}")
    if a.device is None:
        a.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options.check_device(ap, a.device)
    # offload=True everywhere it can run: on a GPU, and on a machine without one (the CPU path
    # of the same pipeline); with a GPU present the engine refuses CPU parameters to offload.
    a.offload = a.device.type == "cuda" or not torch.cuda.is_available()
    a.autocast = a.device.type == "cuda"  # bf16 autocast on the GPU; fp32 on the CPU
    if a.tiny and a.device.type == "cpu":
        # A 64-wide model gains nothing from more threads, and on busy shared cores their
        # spinning cost 5-15x (460 against 70 ms a Muon step on 2 shared cores, 2026-12-01).
        torch.set_num_threads(1)
    return a


def write_json(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)  # never a half-written file, also when killed mid-write


# What may differ between runs that are merged: everything else in "config" and "data" must match.
PER_RUN = ("modes", "time_limit_s")


def merge(runs: list[Path], out: Path) -> dict:
    """One record of several runs' modes, as if one run had trained them all: same config
    (model, steps, seed, data). A mode that finished wins over one that was skipped; the modes
    keep the default order. Each mode keeps its run's environment (date, versions); times of
    runs that shared a GPU are not comparable with a run alone, the losses are."""
    records = []
    for run in runs:
        path = run / "train_compare.json" if run.is_dir() else run
        records.append((path, json.loads(path.read_text())))
    first_path, first = records[0]

    def fixed(r: dict) -> dict:
        return {k: v for k, v in r["config"].items() if k not in PER_RUN}

    for path, r in records[1:]:
        if fixed(r) != fixed(first) or r["data"]["sha256"] != first["data"]["sha256"]:
            raise SystemExit(f"{path}: another config or corpus than {first_path}: not merged")
    modes: dict[str, dict] = {}
    for path, r in records:
        for name, rec in r["modes"].items():
            if name not in modes or modes[name]["status"] == "skipped":
                modes[name] = {**rec, "run": str(path), "environment": r["environment"]}
    order = [*DEFAULT_MODES, *(m for m in MODES if m not in DEFAULT_MODES)]
    modes = {m: modes[m] for m in sorted(modes, key=order.index)}
    config = {**first["config"], "modes": list(modes)}
    result = {
        **first,
        "config": config,
        "modes": modes,
        "merged_from": [str(p) for p, _ in records],
    }
    out.mkdir(parents=True, exist_ok=True)
    result["figure"] = figure(result, out / "train_compare.png")
    write_json(out / "train_compare.json", result)
    print(table(result))
    return result


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.merge:
        merge(a.merge, a.out)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = a.out / "train_compare.json", a.out / "train_compare.png"
    t0 = time.perf_counter()
    corpus = stdlib_corpus()
    data = {
        "train": corpus.train.to(a.device),
        "val": corpus.val.to(a.device),
        "starts": window_starts(corpus.train.numel(), a.seq, a.steps, a.batch, a.seed).to(a.device),
        "val_starts": window_starts(
            corpus.val.numel(), a.seq, a.val_batches, a.batch, a.seed + 1
        ).to(a.device),
    }
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(a.dim, a.layers, a.heads, a.seq).parameters())
    tokens = a.batch * a.seq
    config = {k: getattr(a, k) for k in (*FULL, "seed", "modes", "offload", "autocast")}
    config["time_limit_s"] = a.time_limit
    config.update(device=str(a.device), params=params, tokens_per_step=tokens)
    config["hyper"] = HYPER
    environment = {
        "device": machine.card(a.device),
        "driver": machine.driver_version(),
        **machine.versions(),
        "date": machine.now(),
    }
    result = {"config": config, "data": corpus.info, "environment": environment, "modes": {}}
    print(f"{environment['device']}; torch {environment['torch']}, triton {environment['triton']}")
    print(
        f"model: {params:,} parameters (dim {a.dim}, {a.layers} layers, {a.heads} heads); "
        f"{a.batch} x {a.seq} = {tokens:,} tokens a step, 6ND = "
        f"{6 * params * tokens / 1e12:.2f} TFLOP; {a.steps} steps"
    )
    print(
        f"data: {corpus.info['train_bytes']:,} train / {corpus.info['val_bytes']:,} val bytes "
        f"(Python {corpus.info['python']} stdlib), loaded in {time.perf_counter() - t0:.1f} s"
    )
    result["setup_s"] = time.perf_counter() - t0
    longest = 0.0  # the longest mode so far: what the next one is expected to take
    for i, name in enumerate(a.modes):
        elapsed = time.perf_counter() - t0
        if a.time_limit and elapsed + longest > a.time_limit:
            rec = {
                **describe(MODES[name]),
                "status": "skipped",
                "error": f"--time-limit {a.time_limit:.0f} s: {elapsed:.0f} s gone, a mode "
                f"takes up to {longest:.0f} s",
            }
        else:
            print(f"{name}:", flush=True)
            rec = run_mode(MODES[name], a, data)
        result["modes"][name] = rec
        if rec["status"] == "ok":
            longest = max(longest, rec["wall_s"])
        result["wall_s"] = time.perf_counter() - t0
        # The figure too after every mode: a run killed later still leaves one.
        result["figure"] = figure(result, png_path)
        write_json(json_path, result)
        if rec["status"] != "ok":
            print(f"  {name}: {rec['status']}: {rec['error']}", flush=True)
        elif i + 1 < len(a.modes):
            left = len(a.modes) - i - 1
            print(
                f"  {name}: {rec['wall_s']:.0f} s ({result['wall_s']:.0f} s in all); the {left} "
                f"modes left take up to {left * longest:.0f} s more",
                flush=True,
            )
    print(table(result))
    print(f"wrote {json_path} ({result['wall_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
