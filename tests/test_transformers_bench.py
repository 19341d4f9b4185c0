"""bench/transformers_step.py end to end with --tiny on the CPU (a subprocess, as the GPU run
starts it: dion must run eagerly, which is set before torch is imported): every mode trains
its fresh model, with finite losses and positive times; dion's mode is skipped, saying so,
only where dion is not installed."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason='needs transformers: pip install -e ".[hf]"')

ROOT = Path(__file__).resolve().parents[1]
MODES = ("ours_offload", "ours_resident", "dion_resident", "ours_offload_int8")


def test_tiny_run_records_every_mode(tmp_path):
    out = tmp_path / "sub" / "transformers_step.json"
    cmd = [sys.executable, str(ROOT / "bench" / "transformers_step.py"), "--tiny"]
    cmd += ["--out", str(out)]
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert list(r["modes"]) == list(MODES)  # in the order they run
    model = r["info"]["model"]
    assert model["parameters"] == model["muon_parameters"] + model["adamw_parameters"] > 0
    assert r["info"]["transformers"] and r["info"]["date"]
    args = r["info"]["args"]
    for name in MODES:
        row = r["modes"][name]
        if name == "dion_resident" and importlib.util.find_spec("dion") is None:
            assert "not importable" in row["skipped"]
            continue
        assert "error" not in row, row["error"]
        assert len(row["losses"]) == args["warmup"] + args["iters"]
        assert all(math.isfinite(x) for x in row["losses"])
        assert row["last_loss"] == row["losses"][-1]
        assert len(row["iter_s"]) == len(row["step_s"]) == args["iters"]
        assert all(t > 0 for t in row["iter_s"] + row["step_s"])
        assert 0 < row["median_step_s"] <= row["max_iter_s"]
        assert row["tokens_per_s"] > 0
        assert row["peak_gib"] is None  # no GPU: no memory readings
    # Every mode trained the same model on the same tokens: the first loss is the same.
    firsts = {r["modes"][n]["losses"][0] for n in MODES if "losses" in r["modes"][n]}
    assert len(firsts) == 1
    # Offloaded state lives on the host, the 8-bit codes and scales in fewer bytes.
    offload, int8 = r["modes"]["ours_offload"], r["modes"]["ours_offload_int8"]
    assert 0 < int8["host_state_bytes"] < offload["host_state_bytes"]
    assert r["modes"]["ours_resident"]["host_state_bytes"] == 0
    assert "ours_offload" in proc.stdout and "iter s" in proc.stdout  # the table
