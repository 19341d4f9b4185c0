"""The bench's terminal table, from its results dict; and the number and row formatting that
``bench/`` scripts print their tables with."""

from __future__ import annotations

from collections.abc import Iterable

LABELS = {
    "ours_resident": "ours resident",
    "ours_resident_int8": "ours resident int8",
    "ours_offload_fp32": "ours offload fp32",
    "ours_offload_bf16": "ours offload bf16",
    "ours_offload_int8": "ours offload int8",
    "all_at_once": "all-at-once offload",
    "torch_adamw_fused": "torch AdamW fused",
    "torchao_offload": "torchao offload",
    "dion_resident": "dion resident (eager)",
    "dion_all_at_once": "dion all-at-once offload",
}
SHORT = {
    "ours_resident": "resident",
    "ours_resident_int8": "resident int8",
    "ours_offload_fp32": "offload fp32",
    "ours_offload_bf16": "offload bf16",
    "ours_offload_int8": "offload int8",
    "all_at_once": "all-at-once",
    "torch_adamw_fused": "torch fused",
    "torchao_offload": "torchao",
    "dion_resident": "dion",
}
LABEL_WIDTH = 26
# (header, key in a mode's figures, width, format) of each column of the modes' table. "host
# GiB" is the host memory an offloaded mode's state takes (as the optimizer reports it: for
# 8-bit state codes and scales), "floor s" its transfer floor from the bytes it streams.
MODE_COLUMNS = (
    ("median s", "median_s", 10, ".4f"),
    ("min", "min_s", 9, ".4f"),
    ("max", "max_s", 9, ".4f"),
    ("+GiB", "peak_added_gib", 8, ".2f"),
    ("host GiB", "host_state_gib", 10, ".4g"),
    ("floor s", "floor_s", 9, ".3f"),
    ("/floor", "to_floor", 8, ".2f"),
    ("/dion", "to_dion", 8, ".2f"),
)


def num(x, fmt: str) -> str:
    """``x`` formatted, or ``-`` where it was not measured (None)."""
    return "-" if x is None else format(x, fmt)


def mode_header(columns=MODE_COLUMNS) -> str:
    return f"{'mode':<{LABEL_WIDTH}}" + "".join(f"{h:>{w}}" for h, _, w, _ in columns)


def mode_row(label: str, m: dict, columns=MODE_COLUMNS) -> str:
    return f"{label:<{LABEL_WIDTH}}" + "".join(
        f"{num(m.get(key), fmt):>{w}}" for _, key, w, fmt in columns
    )


def note_row(label: str, text: str) -> str:
    return f"{label:<{LABEL_WIDTH}}{text}"


def bandwidth_text(bw: dict) -> str:
    return (
        f"h2d {bw['h2d_alone']:.1f}, d2h {bw['d2h_alone']:.1f}, both at once "
        f"{bw['both_each']:.1f} each"
    )


def add_ratios(modes: Iterable[tuple[str, dict]], floors: dict, dion: dict) -> None:
    """Each timed mode's median over its transfer floor (None where it has none) and over
    dion's resident median (None where dion did not run)."""
    for key, m in modes:
        fl = floors.get(key)
        m["to_floor"] = m["median_s"] / fl if fl else None
        m["to_dion"] = m["median_s"] / dion["median_s"] if "median_s" in dion else None


def timed_modes(r: dict) -> list[tuple[str, dict]]:
    """(key, figures) of every mode that ran, in table order; dion's all-at-once mode, which
    its subprocess returns inside dion's resident figures, as ``dion_all_at_once``."""
    rows = [(k, r[k]) for k in LABELS if "median_s" in r.get(k, {})]
    dion = r.get("dion_resident", {})
    if "median_s" in dion.get("all_at_once", {}):
        rows.append(("dion_all_at_once", dion["all_at_once"]))
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
        lines.append(f"bandwidth GB/s: {bandwidth_text(bw)}, device copy {bw['device_copy']:.0f}")
    else:
        lines.append(f"bandwidth and transfer floor: not measured ({r['bandwidth_note']})")
    f32, b16, i8 = floor["fp32"], floor["bf16"], floor["int8"]
    lines.append(
        f"state: fp32 {f32['state_gib']:.4g} GiB -> floor {num(f32['floor_s'], '.3f')} s; "
        f"bf16 {b16['state_gib']:.4g} GiB -> floor {num(b16['floor_s'], '.3f')} s; "
        f"int8 (codes + scales, host bytes) {i8['state_gib']:.4g} GiB -> floor "
        f"{num(i8['floor_s'], '.3f')} s"
    )
    lines.append("")
    lines.append(mode_header())
    lines += [mode_row(LABELS[key], m) for key, m in timed_modes(r)]
    for key in ("torch_adamw_fused", "torchao_offload", "dion_resident"):
        m = r.get(key, {})
        if "skipped" in m:
            lines.append(note_row(LABELS[key], m["skipped"]))
        elif "error" in m:
            lines.append(note_row(LABELS[key], f"failed: {m['error'][-400:]}"))
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
    lines += _by_layers(r["memory_by_layers"])
    if r["figures"].get("skipped"):
        lines.append(f"\nfigures: {r['figures']['skipped']}")
    return "\n".join(lines)


def _by_layers(memory: dict) -> list[str]:
    lines = ["by layers: median s / +GiB above weights and grads"]
    names = [k for k in SHORT if any("median_s" in m["modes"].get(k, {}) for m in memory.values())]
    lines.append(f"{'layers':>6}{'state GiB':>11}" + "".join(f"{SHORT[k]:>17}" for k in names))
    for layers, m in memory.items():
        cells = []
        for k in names:
            x = m["modes"].get(k, {})
            cells.append(
                f"{x['median_s']:.3f} / {num(x['peak_added_gib'], '.2f')}"
                if "median_s" in x
                else "-"
            )
        lines.append(f"{layers:>6}{m['state_gib']:>11.4g}" + "".join(f"{c:>17}" for c in cells))
    return lines
