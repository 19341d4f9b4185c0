"""bench/fsdp2_transformers_step.py end to end: torchrun, two gloo processes on CPUs, the tiny
Qwen3-MoE under FSDP2 with bf16 mixed precision. Every mode trains, with finite losses and
positive times; offloading fp32 state changes no loss (bitwise on the CPU); a mode the
optimizer refuses is recorded on every rank and the next mode still runs."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason='needs transformers: pip install -e ".[hf]"')

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "fsdp2_transformers_step.py"
MODES = ("ours_resident", "ours_offload_fp32", "ours_offload_int8", "dion_resident")
ITERS = 2  # timed, after one warm-up: the third loss follows a step that used the momentum


def _run(out: Path, *extra: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", str(SCRIPT), "--tiny", "--device", "cpu", "--out", str(out), *extra]
    path = os.environ.get("PYTHONPATH", "")
    # CPUs only, also on a machine with GPUs (offload=True refuses CPU parameters there).
    env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if re.search(r"Error|Exception", line)]
    why = "\n".join(errors[:20]) + "\n--- tails\n" + proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, why
    return proc, json.loads(out.read_text())


def test_tiny_run_records_every_mode(tmp_path):
    proc, r = _run(tmp_path / "sub" / "fsdp2.json", "--iters", str(ITERS))
    assert list(r["modes"]) == list(MODES)  # in the order they run
    info = r["info"]
    assert info["world_size"] == 2 and info["backend"] == "gloo"
    assert info["transformers"] and info["torch"] and info["date"] and "triton" in info
    model = info["model"]
    assert model["class"] == "Qwen3MoeForCausalLM" and model["num_experts"] == 4
    assert model["parameters"] == model["muon_parameters"] + model["adamw_parameters"] > 0
    for name in MODES:
        row = r["modes"][name]
        if name == "dion_resident" and importlib.util.find_spec("dion") is None:
            assert "not importable" in row["skipped"]
            continue
        if name == "dion_resident" and "skipped" in row:  # gloo without list all_to_all
            assert "all_to_all" in row["skipped"]
            continue
        assert "error" not in row, row["error"]
        assert len(row["losses"]) == 1 + ITERS
        assert all(math.isfinite(x) for x in row["losses"])
        assert len(row["losses_per_rank"]) == 2
        assert len(row["iter_s"]) == len(row["step_s"]) == ITERS
        assert all(t > 0 for t in row["iter_s"] + row["step_s"])
        assert 0 < row["median_step_s"] <= row["max_iter_s"]
        assert row["peak_gib"] is None  # no GPU: no memory readings
        assert row["iter_to_resident"] > 0
    resident, fp32 = r["modes"]["ours_resident"], r["modes"]["ours_offload_fp32"]
    int8 = r["modes"]["ours_offload_int8"]
    # Offload changes nothing of the results: the same losses, bit for bit, on every rank.
    assert fp32["losses_per_rank"] == resident["losses_per_rank"]
    # Every mode trained the same model on the same tokens: the first loss is the same.
    assert len({r["modes"][n]["losses"][0] for n in MODES if "losses" in r["modes"][n]}) == 1
    # Each rank trains on its own tokens.
    assert resident["losses_per_rank"][0][0] != resident["losses_per_rank"][1][0]
    # Offloaded state lives on the host (each rank its shard), 8-bit codes in fewer bytes.
    assert resident["host_state_bytes_per_rank"] == [0, 0]
    host = zip(int8["host_state_bytes_per_rank"], fp32["host_state_bytes_per_rank"], strict=True)
    assert all(0 < a < b for a, b in host)
    assert resident["iter_to_resident"] == 1.0
    assert r["target"]["int8_iter_to_resident"] == int8["iter_to_resident"]
    assert r["target"]["met"] is None  # the peak-memory half is not measured on CPUs
    assert "ours_offload_int8" in proc.stdout and "x res" in proc.stdout  # the table


def test_refused_mode_is_recorded_and_the_next_runs(tmp_path):
    modes = ("ours_offload_fp32", "ours_resident")
    _, r = _run(tmp_path / "fsdp2.json", "--modes", *modes, "--chunk-bytes", "-1")
    refused = r["modes"]["ours_offload_fp32"]
    assert refused["error"].startswith("ValueError") and "chunk_bytes" in refused["error"]
    assert sorted(refused["errors_per_rank"]) == ["0", "1"]  # JSON keys
    assert "error" not in r["modes"]["ours_resident"]
    assert all(math.isfinite(x) for x in r["modes"]["ours_resident"]["losses"])
