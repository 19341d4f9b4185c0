"""The figures of bench/fsdp2_transformers_step.py: one mode's over every rank, the ratios to
the resident mode with 8-bit state's target, and the table."""

from __future__ import annotations

import statistics

from transformers_step import gib

from muon_offload.tools.bench.report import num

# A reference measurement on two H200s (s an iteration), and the target for 8-bit state.
REFERENCE_S = {"ours_resident": 0.192, "ours_offload_fp32": 0.230}
INT8_AT_MOST = 1.03


def combine(ranks: list[dict]) -> dict:
    """One mode's figures from every rank's: per iteration the slowest rank's seconds, memory
    the highest rank's, the loss the mean over ranks (each rank trains on its own tokens)."""
    errors = {r: x["error"] for r, x in enumerate(ranks) if "error" in x}
    if errors:
        return {"error": next(iter(errors.values())), "errors_per_rank": errors}
    n = len(ranks[0]["iter_s"])
    iters = [max(x["iter_s"][k] for x in ranks) for k in range(n)]
    steps = [max(x["step_s"][k] for x in ranks) for k in range(n)]
    losses = [sum(ls) / len(ls) for ls in zip(*(x["losses"] for x in ranks), strict=True)]

    def most(key: str) -> float | None:  # the highest rank's, in GiB; None without a GPU
        values = [x[key] for x in ranks]
        return None if None in values else gib(max(values))

    host = [x["host_state_bytes"] for x in ranks]
    return {
        "median_iter_s": statistics.median(iters),
        "min_iter_s": min(iters),
        "max_iter_s": max(iters),
        "median_step_s": statistics.median(steps),
        "per_rank_median_iter_s": [statistics.median(x["iter_s"]) for x in ranks],
        "peak_gib": most("peak_bytes"),
        "peak_gib_per_rank": [gib(x["peak_bytes"]) for x in ranks],
        "held_gib": most("held_bytes"),  # allocated after the last iteration
        "start_gib": most("start_bytes"),  # allocated before the model was built
        "host_state_bytes_per_rank": host,
        "host_state_gib": gib(max(host)) if None not in host else None,
        "experts_implementation": ranks[0]["experts_implementation"],
        "last_loss": losses[-1],
        "losses": losses,
        "losses_per_rank": [x["losses"] for x in ranks],
        "iter_s": iters,
        "step_s": steps,
    }


def compare(modes: dict) -> dict:
    """Each mode's iteration and peak over the resident one's, and 8-bit state's target."""
    base = modes.get("ours_resident", {})
    for row in modes.values():
        ok = "median_iter_s" in row and "median_iter_s" in base
        row["iter_to_resident"] = row["median_iter_s"] / base["median_iter_s"] if ok else None
        ok = ok and row["peak_gib"] is not None
        row["peak_to_resident"] = row["peak_gib"] / base["peak_gib"] if ok else None
    int8, fp32 = modes.get("ours_offload_int8", {}), modes.get("ours_offload_fp32", {})
    ratio = int8.get("iter_to_resident")
    peaks = (int8.get("peak_gib"), fp32.get("peak_gib"))
    peak_ok = None if None in peaks else peaks[0] <= peaks[1]
    return {
        "int8_iter_to_resident": ratio,
        "int8_iter_to_resident_at_most": INT8_AT_MOST,
        "int8_peak_at_most_offload_fp32": peak_ok,
        "met": None if ratio is None or peak_ok is None else ratio <= INT8_AT_MOST and peak_ok,
        "reference_s": REFERENCE_S,
    }


def table(r: dict) -> str:
    i, m = r["info"], r["info"]["model"]
    lines = [
        f"{i['card']} x {i['world_size']} ({i['backend']}) | torch {i['torch']} | triton "
        f"{i['triton'] or '-'} | transformers {i['transformers']} | {i['date']}",
        f"Qwen3MoeForCausalLM {m['parameters']:,} parameters, FSDP2 bf16 mixed precision; "
        "times and memory: the worst rank's; reference (2 x H200) "
        + ", ".join(f"{k} {v} s" for k, v in REFERENCE_S.items()),
        f"{'mode':<18} {'iter s':>7} {'x res':>6} {'step s':>7} {'peak GiB':>8} {'x res':>6} "
        f"{'host GiB':>8} {'loss':>8}",
    ]
    for name, x in r["modes"].items():
        if "median_iter_s" not in x:
            why = x.get("skipped") or x.get("error", "")
            lines.append(f"{name:<18} {'skipped' if 'skipped' in x else 'error'}: {why[:200]}")
            continue
        lines.append(
            f"{name:<18} {x['median_iter_s']:>7.4f} {num(x['iter_to_resident'], '6.3f'):>6} "
            f"{x['median_step_s']:>7.4f} {num(x['peak_gib'], '8.2f'):>8} "
            f"{num(x['peak_to_resident'], '6.3f'):>6} {num(x['host_state_gib'], '8.3f'):>8} "
            f"{x['last_loss']:>8.4f}"
        )
    t = r.get("target")
    if t and t["int8_iter_to_resident"] is not None:
        verdict = {True: "met", False: "NOT met", None: "peak not measured"}[t["met"]]
        lines.append(
            f"target: offload int8 <= {t['int8_iter_to_resident_at_most']} x resident "
            f"({t['int8_iter_to_resident']:.3f} x), peak <= offload fp32's "
            f"({t['int8_peak_at_most_offload_fp32']}): {verdict}"
        )
    return "\n".join(lines)
