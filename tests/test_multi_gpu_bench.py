"""bench/multi_gpu.py end to end: torchrun, two processes over gloo on CPUs, the tiny model."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "multi_gpu.py"
HAS_DION = importlib.util.find_spec("dion") is not None
# The modes every run times (the 8-bit ones: test_offloaded_modes_report_host_bytes).
MODES = ("ours_offload_fp32", "ours_offload_bf16", "ours_resident", "dion_resident", "all_at_once")
STEPS = 2


def _failure(proc) -> str:
    """The lines that name an error first (torchrun's own report fills the tail and cut the
    cause off on 2026-11-30), then the tails."""
    errors = [line for line in proc.stderr.splitlines() if re.search(r"Error|Exception", line)]
    return "\n".join(errors[:20]) + "\n--- stdout\n" + proc.stdout[-2000:] + proc.stderr[-2000:]


def _tiny(out, *extra):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--tiny",
        "--device",
        "cpu",
        "--warmup",
        "1",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        *extra,
    ]
    path = os.environ.get("PYTHONPATH", "")
    # CPUs only, also on a machine with GPUs: with CUDA present, offload=True refuses CPU
    # parameters (engine._check_step) rather than silently taking the CPU path.
    env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, _failure(proc)
    return proc, json.loads((out / "multi_gpu.json").read_text())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("multi_gpu"))


def test_every_mode_timed_over_both_ranks(tiny_run):
    _, r = tiny_run
    assert r["info"]["world_size"] == 2 and r["info"]["backend"] == "gloo"
    dion = r["modes"]["dion_resident"]
    if not HAS_DION:
        assert "skipped" in dion
    elif "skipped" in dion:  # gloo without the list-form all_to_all that dion uses
        assert "all_to_all" in dion["skipped"]
        assert tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13)
    dion_ran = "skipped" not in dion
    for mode in MODES:
        m = r["modes"][mode]
        if mode == "dion_resident" and not dion_ran:
            continue
        assert m["steps"] == STEPS and len(m["times_s"]) == STEPS, mode
        assert 0 < m["min_s"] <= m["median_s"] <= m["max_s"], mode
        # The step time is the slowest rank's.
        assert m["median_s"] >= min(m["per_rank_median_s"]) and len(m["per_rank_median_s"]) == 2
        assert m["peak_gib"] is None and m["peak_added_gib"] is None  # no GPU
    around = r["modes"]["all_at_once"]["around"]
    assert around == ("dion_resident" if dion_ran else "ours_resident")


def test_no_floor_without_a_gpu(tiny_run):
    _, r = tiny_run
    assert r["bandwidth_gbps"] is None and "no CUDA GPU" in r["bandwidth_note"]
    assert r["floor"]["fp32"]["floor_s"] is None and r["floor"]["bf16"]["floor_s"] is None
    assert r["target"]["met"] is None


def test_shards_partition_the_model(tiny_run):
    _, r = tiny_run
    m = r["model"]
    assert m["ep"] == 2 and sum(m["params_per_rank"]) == m["params_global"]
    # The vocabulary (143 rows) is sharded unevenly: the ranks' states differ.
    assert len(set(m["state_bytes_per_rank"])) == 2


def test_parity_with_one_process(tiny_run):
    proc, r = tiny_run
    p = r["parity"]
    assert p["within_tolerance"] and p["max_rel_update_diff"] <= p["rel_tolerance"]
    # Whole expert matrices and element-wise AdamW take the same arithmetic in both runs.
    assert p["by_role"]["experts"]["bitwise"] and p["by_role"]["adamw"]["bitwise"]
    assert "parity" in proc.stdout and "ours offload fp32" in proc.stdout


def test_offloaded_modes_report_host_bytes(tiny_run):
    """Each offloaded mode reports every rank's host state bytes (the optimizer's own figure);
    fp32's hold at least the fp32 state, 8-bit's less (the embedding and head, DTensors, are
    large enough for 8-bit state)."""
    proc, r = tiny_run
    modes, state = r["modes"], r["model"]["state_bytes_per_rank"]
    fp32 = modes["ours_offload_fp32"]["host_state_bytes_per_rank"]
    assert all(h >= s for h, s in zip(fp32, state, strict=True))
    assert modes["ours_offload_fp32"]["floor_s"] is None  # no GPU: no bandwidth
    bf16 = modes["ours_offload_bf16"]["host_state_bytes_per_rank"]
    assert all(b < f for b, f in zip(bf16, fp32, strict=True))
    for mode in ("ours_offload_int8", "ours_resident_int8"):
        m = modes[mode]
        assert m["steps"] == STEPS and m["median_s"] > 0, m
        assert "ours " + mode.split("_", 1)[1].replace("_", " ") in proc.stdout
    int8 = modes["ours_offload_int8"]["host_state_bytes_per_rank"]
    assert all(i < f for i, f in zip(int8, fp32, strict=True))
    assert r["floor"]["int8"]["floor_s"] is None


def test_parity_with_8bit_state(tmp_path):
    """--parity-state-dtype int8: both runs keep 8-bit state; the embedding's shards start on
    block boundaries (72 rows of 32 on rank 1), so the ranks' blocks are one process's and
    every tensor comes out bitwise equal on CPUs (docs/design.md, 8-bit state under FSDP2)."""
    extra = ("--modes", "ours_offload_int8", "--parity-state-dtype", "int8", "--no-dion")
    proc, r = _tiny(tmp_path, *extra)
    p = r["parity"]
    assert p["state_dtype"] == "int8" and "int8 state" in proc.stdout
    assert all(v["bitwise"] for v in p["by_role"].values()), p
