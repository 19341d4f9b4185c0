"""The multi-GPU bench's transfer floors and ratios: each rank's state bytes over its
both-directions bandwidth, the worst rank's floor, and each timed mode against it."""

from __future__ import annotations

from muon_offload.tools.bench.report import add_ratios
from muon_offload.tools.bench.timing import GIB, STATE_DTYPES, floor_s

TARGET_TO_FLOOR = 1.2  # the target: the offloaded step at most 1.2 x the per-rank floor


def rank_floor(per_rank_bytes: list[float], per_rank_bw: list[dict] | None) -> dict:
    """Each rank's state bytes over its both-directions bandwidth; the floor is the max."""
    per_rank = (
        [floor_s(b, bw) for b, bw in zip(per_rank_bytes, per_rank_bw, strict=True)]
        if per_rank_bw
        else None
    )
    return {
        "state_gib_per_rank": [b / GIB for b in per_rank_bytes],
        "floor_s_per_rank": per_rank,
        "floor_s": max(per_rank) if per_rank else None,
    }


def floors(per_rank_state: list[int], per_rank_bw: list[dict] | None) -> dict:
    """The floor of fp32 and bf16 state, from each rank's fp32 state bytes."""
    return {
        name: rank_floor([b * scale for b in per_rank_state], per_rank_bw)
        for name, scale in STATE_DTYPES
    }


def measured_floors(results: dict) -> None:
    """Each offloaded mode's floor from the host bytes every rank reports (max over ranks), and
    the 8-bit floor in ``results["floor"]``."""
    bw = results["bandwidth_gbps"]
    per_rank_bw = bw["per_rank"] if bw else None
    for m in results["modes"].values():
        if "host_state_bytes_per_rank" in m:
            m["floor_s"] = rank_floor(m["host_state_bytes_per_rank"], per_rank_bw)["floor_s"]
    int8 = results["modes"].get("ours_offload_int8", {})
    if "host_state_bytes_per_rank" in int8:
        results["floor"]["int8"] = rank_floor(int8["host_state_bytes_per_rank"], per_rank_bw)


def ratios(results: dict) -> None:
    measured_floors(results)
    floor, modes = results["floor"], results["modes"]
    fp32, bf16 = floor["fp32"]["floor_s"], floor["bf16"]["floor_s"]
    floors_of = {"ours_offload_fp32": fp32, "ours_offload_bf16": bf16, "all_at_once": fp32}
    floors_of.update({k: m["floor_s"] for k, m in modes.items() if "floor_s" in m})
    timed_modes = [(k, m) for k, m in modes.items() if "median_s" in m]
    add_ratios(timed_modes, floors_of, modes.get("dion_resident", {}))
    to_floor = modes.get("ours_offload_fp32", {}).get("to_floor")
    results["target"] = {
        "offload_fp32_to_floor_at_most": TARGET_TO_FLOOR,
        "offload_fp32_to_floor": to_floor,
        "met": to_floor <= TARGET_TO_FLOOR if to_floor is not None else None,
    }
