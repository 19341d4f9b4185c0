"""bench/training_loop.py's figures: a mode's row from what its iterations measured, the table
printed, and what the run ran on (the JSON's ``info``)."""

from __future__ import annotations

import os
import shlex
import statistics

import torch
from training_loop_copy import AFTER_CLIP
from transformers_step import gib

from muon_offload.tools.bench import machine
from muon_offload.tools.bench.dion_runner import dion_commit
from muon_offload.tools.bench.report import num


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def row(copy) -> dict:
    """One mode's figures; step columns None for ``no_step``, memory None on the CPU."""
    opt = copy.opt
    stats = getattr(opt, "graph_stats", None)  # ours; dion's and torch's have none
    own = None if copy.held is None or copy.added is None else copy.held + copy.added
    return {
        "median_iter_s": statistics.median(copy.iter_s),
        "min_iter_s": min(copy.iter_s),
        "max_iter_s": max(copy.iter_s),
        "median_step_ms": median(copy.step_ms),
        "median_host_ms": median(copy.host_ms),
        "host_over_step": ratio(median(copy.host_ms), median(copy.step_ms)),
        "first_step_s": copy.first_step["s"] if copy.first_step else None,
        "first_step_host_s": copy.first_step["host_s"] if copy.first_step else None,
        "graph": stats() if stats else None,
        "peak_allocated_gib": gib(copy.peak),
        "peak_reserved_gib": gib(copy.reserved),
        "held_gib": gib(copy.held),
        "own_peak_gib": gib(own),
        "host_state_gib": gib(getattr(opt, "host_state_bytes", None)),
        "staging_gib": gib(getattr(opt, "staging_bytes", None)),
        "prefetch_bytes": getattr(opt, "prefetch_bytes", None),  # None: the default
        "median_phase_ms": {k: median(v) for k, v in copy.phase_ms.items()},
        "phase_ms": copy.phase_ms,
        "median_b2b_phase_ms": {k: median(v) for k, v in copy.b2b_phase_ms.items()},
        "b2b_phase_ms": copy.b2b_phase_ms,
        "median_run_s": median(copy.run_s),
        "run_s": copy.run_s,
        "last_loss": copy.losses[-1],
        "losses": copy.losses,
        "iter_s": copy.iter_s,
        "step_ms": copy.step_ms,
        "host_ms": copy.host_ms,
    }


def summary(copies: dict) -> dict:
    """Every live copy's row with its step share: its median iteration minus ``no_step``'s
    (None without a live ``no_step``)."""
    new = {name: row(copy) for name, copy in copies.items()}
    base = new.get("no_step", {})
    for r in new.values():
        for key, share in (("median_iter_s", "step_share_s"), ("median_run_s", "run_share_s")):
            b = base.get(key)
            r[share] = None if b is None or r[key] is None else r[key] - b
    return new


def graphs(stats: dict | None) -> str:
    """Captures / replays / eager steps / replays whose first loads ran ahead (under
    backward: the heads that ``prefetch()`` replayed)."""
    if stats is None:
        return "-"
    ahead = stats.get("heads_ahead", 0)
    return f"{stats['captures']}/{stats['replays']}/{stats['eager_steps']}/{ahead}"


COLUMNS = (
    ("mode", "<18"),
    ("iter s", ">7"),
    ("share s", ">7"),
    ("b2b s", ">7"),
    ("b2b share", ">9"),
    ("step ms", ">8"),
    ("host ms", ">8"),
    ("first s", ">7"),
    ("graph c/r/e/a", ">13"),
    ("peak GiB", ">8"),
    ("rsrvd GiB", ">9"),
    ("own GiB", ">7"),
    ("loss", ">7"),
)


def table(rows: dict) -> str:
    """A markdown table: one line a mode, in the order the modes ran."""
    lines = [
        "| " + " | ".join(format(name, spec) for name, spec in COLUMNS) + " |",
        "|"
        + "|".join(
            "-" * (int(spec[1:]) + 1) + ("-" if spec[0] == "<" else ":") for _, spec in COLUMNS
        )
        + "|",
    ]
    for name, r in rows.items():
        if "median_iter_s" not in r:
            why = r.get("skipped") or r.get("error", "")
            what = "skipped" if "skipped" in r else "error"
            cells = [name, f"{what}: {why[:160]}"] + [""] * (len(COLUMNS) - 2)
        else:
            cells = [
                name,
                f"{r['median_iter_s']:.4f}",
                num(r["step_share_s"], ".4f"),
                num(r.get("median_run_s"), ".4f"),
                num(r.get("run_share_s"), ".4f"),
                num(r["median_step_ms"], ".2f"),
                num(r["median_host_ms"], ".2f"),
                num(r["first_step_s"], ".3f"),
                graphs(r["graph"]),
                num(r["peak_allocated_gib"], ".2f"),
                num(r["peak_reserved_gib"], ".2f"),
                num(r["own_peak_gib"], ".2f"),
                f"{r['last_loss']:.4f}",
            ]
        lines.append(
            "| "
            + " | ".join(format(c, spec) for c, (_, spec) in zip(cells, COLUMNS, strict=True))
            + " |"
        )
    return "\n".join(lines)


def eager_lines(rows: dict, twins: dict[str, str]) -> list[str]:
    """For each eager mode run (``twins``: eager mode -> its graphed one), the host time to
    issue its step (median, and its range over the iterations: a host's pace moves between
    runs and iterations) against the step's GPU time (on the CPU, its host time: a ratio of 1), and
    against its graphed twin's GPU time (the same work, no launch issued by the host)."""
    lines = []
    for name, twin in twins.items():
        r = rows.get(name, {})
        if r.get("host_over_step") is None:
            continue
        graphed = rows.get(twin, {})
        over_graphed = ratio(r["median_host_ms"], graphed.get("median_step_ms"))
        spread = (
            f" ({min(r['host_ms']):.2f} to {max(r['host_ms']):.2f})" if r.get("host_ms") else ""
        )
        lines.append(
            f"{name}: host {r['median_host_ms']:.2f} ms{spread} to issue a step of "
            f"{r['median_step_ms']:.2f} ms on the device: {r['host_over_step']:.0%} "
            f"(graphed, {twin}: host {num(graphed.get('median_host_ms'), '.2f')} ms, "
            f"step {num(graphed.get('median_step_ms'), '.2f')} ms on the device: "
            f"the eager host {num(over_graphed, '.0%')} of it)"
        )
    return lines


def phase_lines(rows: dict, against: str = "dion_resident") -> list[str]:
    """Each mode's median device ms of forward, backward and clip and what the iteration took
    after the clip (CUDA runs); that last beside ``against``'s, both less ``no_step``'s."""
    after = {n: r.get("median_phase_ms", {}).get(AFTER_CLIP) for n, r in rows.items()}
    base, theirs = after.get("no_step") or 0.0, after.get(against)
    lines = []
    for name, r in rows.items():
        phases = r.get("median_phase_ms")
        if phases:
            cells = ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
            line = f"{name}: device ms: {cells}"
            b2b = r.get("median_b2b_phase_ms")
            if b2b:
                line += "; back to back: " + ", ".join(f"{k} {v:.1f}" for k, v in b2b.items())
            if theirs is not None and theirs > base and name not in ("no_step", against):
                line += f"; after clip / {against}'s: {(after[name] - base) / (theirs - base):.3f}"
            lines.append(line)
    return lines


def environment(args, dion, argv: list[str]) -> dict:
    import transformers

    device = args.device
    info = {
        "card": machine.card(device),
        "driver": machine.driver_version() if device.type == "cuda" else None,
        **machine.versions(),
        "transformers": transformers.__version__,
        "dion": None,
        "date": machine.now(),
        "command": shlex.join(argv),
        "args": {k: str(v) if isinstance(v, torch.device) else v for k, v in vars(args).items()},
        "loop": "fp32 weights, bf16 autocast forward, backward, clip_grad_norm_(1.0), step, "
        "zero_grad() (set_to_none=True)",
    }
    if dion is not None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(dion.__file__)))
        info["dion"] = dion_commit(root) or root
    return info
