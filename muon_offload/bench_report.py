"""The bench's terminal table and PNG figures, from its results dict (``bench.py``)."""

from __future__ import annotations

from pathlib import Path

LABELS = {
    "ours_resident": "ours resident",
    "ours_offload_fp32": "ours offload fp32",
    "ours_offload_bf16": "ours offload bf16",
    "all_at_once": "all-at-once offload",
    "torch_adamw_fused": "torch AdamW fused",
    "dion_resident": "dion resident (eager)",
    "dion_all_at_once": "dion all-at-once offload",
}
SHORT = {
    "ours_resident": "resident",
    "ours_offload_fp32": "offload fp32",
    "ours_offload_bf16": "offload bf16",
    "all_at_once": "all-at-once",
    "torch_adamw_fused": "torch fused",
    "dion_resident": "dion",
}
LANES = ("load", "copies", "update", "store", "collective")


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _modes(r: dict) -> list[tuple[str, dict]]:
    """(label, figures) of every mode that ran, in table order."""
    rows = [(LABELS[k], r[k]) for k in LABELS if "median_s" in r.get(k, {})]
    dion = r.get("dion_resident", {})
    if "median_s" in dion.get("all_at_once", {}):
        rows.append((LABELS["dion_all_at_once"], dion["all_at_once"]))
    return rows


def table(r: dict) -> str:
    i, bw, floor = r["info"], r["bandwidth_gbps"], r["floor"]
    a = i["args"]
    lines = [
        f"{i['card']} | driver {i['driver'] or '-'} | torch {i['torch']} | "
        f"triton {i['triton'] or '-'} | {i['date']}",
        f"workload {a['workload']}, {a['layers']} layers; {a['warmup']} warm-up + "
        f"{a['steps']} timed steps per mode",
    ]
    if bw:
        lines.append(
            f"bandwidth GB/s: h2d {bw['h2d_alone']:.1f}, d2h {bw['d2h_alone']:.1f}, both at once "
            f"{bw['both_each']:.1f} each, device copy {bw['device_copy']:.0f}"
        )
    else:
        lines.append(f"bandwidth and transfer floor: not measured ({r['bandwidth_note']})")
    f32, b16 = floor["fp32"], floor["bf16"]
    lines.append(
        f"state: fp32 {f32['state_gib']:.4g} GiB -> floor {_num(f32['floor_s'], '.3f')} s; "
        f"bf16 {b16['state_gib']:.4g} GiB -> floor {_num(b16['floor_s'], '.3f')} s"
    )
    lines.append("")
    lines.append(
        f"{'mode':<26}{'median s':>10}{'min':>9}{'max':>9}{'+GiB':>8}{'/floor':>8}{'/dion':>8}"
    )
    for label, m in _modes(r):
        lines.append(
            f"{label:<26}{m['median_s']:>10.4f}{m['min_s']:>9.4f}{m['max_s']:>9.4f}"
            f"{_num(m['peak_added_gib'], '.2f'):>8}{_num(m.get('to_floor'), '.2f'):>8}"
            f"{_num(m.get('to_dion'), '.2f'):>8}"
        )
    for key in ("torch_adamw_fused", "dion_resident"):
        m = r.get(key, {})
        if "skipped" in m:
            lines.append(f"{LABELS[key]:<26}{m['skipped']}")
        elif "error" in m:
            lines.append(f"{LABELS[key]:<26}failed: {m['error'][-400:]}")
    for key, name in (("chunk_sweep", "fp32"), ("chunk_sweep_bf16", "bf16")):
        sweep = {k: round(v["median_s"], 4) for k, v in r.get(key, {}).items()}
        lines.append(f"chunk sweep (offload {name}, MiB: median s): {sweep}")
    sd = r.get("state_dict")
    if sd:
        added = sd["peak_added_bytes"]
        lines.append(
            f"state_dict (offload fp32, {sd['state_bytes'] / 2**30:.4g} GiB): call "
            f"{sd['call_s'] * 1e3:.2f} ms, reading what it returns "
            f"{sd['read_through_state_dict_s']:.3f} s vs reading the host slabs "
            f"{sd['read_slabs_s']:.3f} s; GPU memory added "
            f"{'-' if added is None else added} bytes"
        )
    lines.append("")
    lines.append("by layers: median s / +GiB above weights and grads")
    memory = r["memory_by_layers"]
    names = [k for k in SHORT if any("median_s" in m["modes"].get(k, {}) for m in memory.values())]
    lines.append(f"{'layers':>6}{'state GiB':>11}" + "".join(f"{SHORT[k]:>17}" for k in names))
    for layers, m in memory.items():
        cells = []
        for k in names:
            x = m["modes"].get(k, {})
            cells.append(
                f"{x['median_s']:.3f} / {_num(x['peak_added_gib'], '.2f')}"
                if "median_s" in x
                else "-"
            )
        lines.append(f"{layers:>6}{m['state_gib']:>11.4g}" + "".join(f"{c:>17}" for c in cells))
    if r["figures"].get("skipped"):
        lines.append(f"\nfigures: {r['figures']['skipped']}")
    return "\n".join(lines)


def figures(r: dict, timeline_png: Path, state_png: Path) -> dict:
    """Draw both figures; without matplotlib say so and draw nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"skipped": "matplotlib is not installed: no figures (pip install matplotlib)"}
    _timeline_figure(plt, r, timeline_png)
    _state_size_figure(plt, r, state_png)
    return {"files": [str(timeline_png), str(state_png)]}


def _timeline_figure(plt, r: dict, path: Path) -> None:
    rows = r["timeline_fp32"]
    recorded = {row["stage"] for row in rows}
    # The GPU lanes are drawn even when empty, so a stage the scheduler does not mark shows.
    shown = recorded | {"collective"} | (set() if "copies" in recorded else {"load", "store"})
    lanes = [s for s in LANES if s in shown]
    colors = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(11, 0.7 * len(lanes) + 1.6))
    for row in rows:
        y = lanes.index(row["stage"])
        width = row["end_ms"] - row["start_ms"]
        ax.barh(
            y,
            width,
            left=row["start_ms"],
            height=0.6,
            color=colors[row["chunk"] % len(colors)],
            edgecolor="black",
            linewidth=0.3,
        )
    notes = {"collective": "none yet", "copies": "CPU: serial"}
    labels = [
        f"{s}\n({notes[s]})" if s in notes else s if s in recorded else f"{s}\n(not recorded)"
        for s in lanes
    ]
    ax.set_yticks(range(len(lanes)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's first mark")
    a, i = r["info"]["args"], r["info"]
    chunks = len({row["chunk"] for row in rows})
    ax.set_title(
        f"one offloaded step (fp32 state), {a['workload']} {a['layers']} layers, "
        f"{chunks} chunks; colour = chunk\n{i['card']}, torch {i['torch']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _state_size_figure(plt, r: dict, path: Path) -> None:
    memory = r["memory_by_layers"]
    layers = list(memory)
    x = [memory[n]["state_gib"] for n in layers]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in LABELS.items():
        ms = [memory[n]["modes"].get(key, {}) for n in layers]
        if key == "dion_all_at_once":
            ms = [
                memory[n]["modes"].get("dion_resident", {}).get("all_at_once", {}) for n in layers
            ]
        pts = [(xi, m) for xi, m in zip(x, ms, strict=True) if "median_s" in m]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ax_t.plot(xs, [p[1]["median_s"] for p in pts], "o-", label=label)
        mem = [(xi, m["peak_added_gib"]) for xi, m in pts if m["peak_added_gib"] is not None]
        if mem:
            ax_m.plot([p[0] for p in mem], [p[1] for p in mem], "o-", label=label)
    for xi, n in zip(x, layers, strict=True):
        ax_t.annotate(
            f"{n} layers",
            (xi, 0),
            xycoords=("data", "axes fraction"),
            textcoords="offset points",
            xytext=(0, 4),
            ha="center",
            fontsize=7,
        )
    ax_t.set_xlabel("optimizer state, fp32 (GiB)")
    ax_t.set_ylabel("step time, median (s)")
    ax_t.legend(fontsize=7)
    ax_m.set_xlabel("optimizer state, fp32 (GiB)")
    ax_m.set_ylabel("peak GPU memory above weights and grads (GiB)")
    if not ax_m.lines:
        ax_m.text(0.5, 0.5, "not measured: no GPU", ha="center", transform=ax_m.transAxes)
    else:
        ax_m.legend(fontsize=7)
    i = r["info"]
    fig.suptitle(
        f"{i['args']['workload']}: step time and memory against state size\n"
        f"{i['card']}, torch {i['torch']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
