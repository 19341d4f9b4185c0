"""bench/train_compare.py's table and figure, from its JSON record alone (so a partial run's
JSON can be redrawn)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from muon_offload.tools.bench.report import num

TARGET = 0.01  # 8-bit state's final loss within 1% of fp32's
# Overlapping curves stay visible: the state format sets the line style.
STYLES = {"torch.float32": "-", "torch.bfloat16": "--", "torch.int8": ":"}
PANELS = (("muon", "Muon (matrices) + AdamW (embeddings, head, norms)"), ("adamw", "AdamW only"))


def reference(name: str, rec: dict) -> str:
    return f"{rec['optimizer']}_fp32"


def ratio(result: dict, name: str) -> float | None:
    """A mode's final loss over its optimizer's fp32 mode's; None where either did not finish."""
    modes = result["modes"]
    ref = modes.get(reference(name, modes[name]))
    if not ref or modes[name].get("final") is None or ref.get("final") is None:
        return None
    return modes[name]["final"] / ref["final"]


def table(result: dict) -> str:
    cfg, env = result["config"], result["environment"]
    window = cfg["final_window"]
    lines = [
        f"{env['device']}; torch {env['torch']}, triton {env['triton']}; {cfg['params']:,} "
        f"parameters, {cfg['tokens_per_step']:,} tokens/step, {cfg['steps']} steps",
        f"{'mode':<16} {'status':<9} {f'final({window})':>10} {'vs fp32':>8} {'val':>7} "
        f"{'ms/step':>8} {'1st step s':>10} {'peak GiB':>9}",
    ]
    modes = result["modes"]
    for name, rec in modes.items():
        peak = rec.get("peak_gpu_mib")
        lines.append(
            f"{name:<16} {rec['status']:<9} {num(rec.get('final'), '.4f'):>10} "
            f"{num(ratio(result, name), '.4f'):>8} {num(rec.get('final_val'), '.4f'):>7} "
            f"{num(rec.get('step_ms_median'), '.1f'):>8} "
            f"{num(rec.get('first_step_s'), '.2f'):>10} "
            f"{num(peak and peak / 1024, '.2f'):>9}"
        )
    for name, rec in modes.items():
        if rec["status"] != "ok" and rec.get("error"):
            lines.append(f"  {name}: {rec['error'].splitlines()[0][:160]}")
    for name, rec in modes.items():
        if rec["state_dtype"] != "torch.int8":
            continue
        r = ratio(result, name)
        verdict = (
            "not measured"
            if r is None
            else f"{r:.4f}: {'within' if abs(r - 1) <= TARGET else 'NOT within'} {TARGET:.0%}"
        )
        lines.append(f"target, {name} / {reference(name, rec)}: {verdict}")
    return "\n".join(lines)


def smooth(xs: list[float], window: int) -> np.ndarray:
    """Trailing mean over ``window`` steps (fewer at the start)."""
    x = np.asarray(xs, dtype=np.float64)
    c = np.concatenate(([0.0], np.cumsum(x)))
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(0, i - window)
    return (c[i] - c[lo]) / (i - lo)


def figure(result: dict, path: Path) -> dict:
    """Top row: smoothed training losses (lines) and validation losses (dots), one panel per
    optimizer. Bottom row: each smoothed curve against its optimizer's fp32 one, in percent,
    with the +-1% target shaded. Without matplotlib say so and draw nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"skipped": "matplotlib is not installed: no figure (pip install matplotlib)"}
    cfg, env, modes = result["config"], result["environment"], result["modes"]
    window = max(1, cfg["steps"] // 40)
    smoothed = {n: smooth(r["losses"], window) for n, r in modes.items() if r.get("losses")}
    fig, axes = plt.subplots(
        2, 2, figsize=(13, 8), sharex="col", sharey="row", height_ratios=(3, 2), squeeze=False
    )
    tops, bottoms, spread = [], [], [4 * 100 * TARGET]
    for col, (optimizer, title) in enumerate(PANELS):
        top, bottom = axes[0, col], axes[1, col]
        for i, (name, rec) in enumerate(modes.items()):
            if rec["optimizer"] != optimizer or name not in smoothed:
                continue
            color, y = f"C{i}", smoothed[name]
            style = "-." if rec["gram"] else STYLES.get(rec["state_dtype"], "-")
            r = ratio(result, name)
            label = name + ("" if r is None else f" (final {rec['final']:.4f}, x{r:.4f})")
            top.plot(np.arange(1, len(y) + 1), y, style, color=color, lw=1.2, label=label)
            if rec.get("val"):
                steps, vals = zip(*rec["val"], strict=True)
                top.plot(steps, vals, "o", color=color, ms=3)
            finite = y[np.isfinite(y)]
            if finite.size:
                bottoms.append(finite.min())
                # The top of the view: past the first tenth of the run, where the modes differ.
                tops.append(finite[len(finite) // 10 :].max())
            ref = smoothed.get(reference(name, rec))
            if ref is not None and name != reference(name, rec):
                n = min(len(y), len(ref))
                diff = 100 * (y[:n] / ref[:n] - 1)
                bottom.plot(np.arange(1, n + 1), diff, style, color=color, lw=1)
                late = np.abs(diff[n // 10 :])
                spread.append(min(50.0, 1.1 * late[np.isfinite(late)].max(initial=0.0)))
        top.set_title(title)
        top.grid(alpha=0.3)
        if top.get_legend_handles_labels()[0]:
            top.legend(fontsize=8)
        bottom.axhspan(-100 * TARGET, 100 * TARGET, color="0.9", zorder=0)
        bottom.axhline(0, color="0.5", lw=0.8)
        bottom.set_xlabel("step")
        bottom.grid(alpha=0.3)
    axes[0, 0].set_ylabel(f"train loss, nats/byte (mean of {window} steps); dots: validation")
    axes[1, 0].set_ylabel(f"vs the fp32 run, % (shaded: +-{TARGET:.0%})")
    if tops:
        lo, hi = min(bottoms), max(tops)
        axes[0, 0].set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
    axes[1, 0].set_ylim(-max(spread), max(spread))  # at least +-4%, wider if a mode strays
    fig.suptitle(
        f"{cfg['params'] / 1e6:.1f} M-parameter byte-level GPT on the Python stdlib, "
        f"{cfg['steps']} steps x {cfg['tokens_per_step']:,} tokens; {env['device']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"files": [str(path)]}
