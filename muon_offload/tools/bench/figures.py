"""The bench's PNG figures (with matplotlib): one offloaded step chunk by chunk, and step time
and memory against state size."""

from __future__ import annotations

from pathlib import Path

from .report import LABELS

LANES = ("load", "update", "store", "collective")


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
    # Every lane is drawn, also when empty, so a stage the scheduler does not mark shows.
    lanes = list(LANES) + sorted(recorded - set(LANES))
    colors = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(11, 0.7 * len(lanes) + 1.6))
    for row in rows:
        ax.barh(
            lanes.index(row["stage"]),
            row["end_ms"] - row["start_ms"],
            left=row["start_ms"],
            height=0.6,
            color=colors[row["chunk"] % len(colors)],
            edgecolor="black",
            linewidth=0.3,
        )
    notes = {"collective": "none yet"}
    labels = [
        f"{s}\n({notes[s]})" if s in notes else s if s in recorded else f"{s}\n(not recorded)"
        for s in lanes
    ]
    ax.set_yticks(range(len(lanes)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's first mark")
    a, i = r["info"]["args"], r["info"]
    chunks = len({row["chunk"] for row in rows})
    serial = "; CPU: the stages run one after another" if i["device"] == "cpu" else ""
    ax.set_title(
        f"one offloaded step (fp32 state), {a['workload']} {a['layers']} layers, "
        f"{chunks} chunks; colour = chunk{serial}\n{i['card']}, torch {i['torch']}",
        fontsize=9,
    )
    _save(plt, fig, path)


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
    _save(plt, fig, path)


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
