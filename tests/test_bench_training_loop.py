"""bench/training_loop.py end to end on the CPU (a subprocess, as the GPU run starts it: dion
must run eagerly, which is set before torch is imported): a 1-layer tiny dense and MoE model,
one warm-up iteration, one round of two (and two back to back); every mode's row and table
line, with finite figures; dion's row skipped, saying so, only where dion is not installed."""

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
MODES = (
    "no_step",
    "ours_resident",
    "ours_resident_eager",
    "ours_offload_fp32",
    "ours_offload_int8",
    "ours_offload_int8_eager",
    "dion_resident",
    "torch_adamw",
)
EAGER = {"ours_resident_eager": "ours_resident", "ours_offload_int8_eager": "ours_offload_int8"}
OURS = ("ours_resident", "ours_offload_fp32", "ours_offload_int8", *EAGER)
WARMUP, ROUNDS, ITERS = 1, 1, 2


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("training_loop") / "sub" / "tl.json"
    cmd = [sys.executable, str(ROOT / "bench" / "training_loop.py"), "--tiny", "--layers", "1"]
    cmd += ["--device", "cpu", "--warmup", str(WARMUP), "--rounds", str(ROUNDS)]
    cmd += ["--iters", str(ITERS), "--back-to-back", "--json", str(out)]
    path = os.environ.get("PYTHONPATH", "")
    # One thread: torch's pool of intra-op threads is many times slower on a busy machine.
    env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


def test_info_records_the_run(run):
    r, _ = run
    info = r["info"]
    assert info["card"].startswith("CPU") and info["torch"] and info["transformers"]
    assert info["date"] and "training_loop.py" in info["command"] and "--tiny" in info["command"]
    assert list(r["models"]) == ["dense", "moe"]
    for model in r["models"].values():
        m = model["model"]
        assert m["parameters"] == m["muon_parameters"] + m["adamw_parameters"] > 0
        assert m["config"]["num_hidden_layers"] == 1
    assert r["models"]["moe"]["model"]["config"]["num_experts"] > 1
    assert r["models"]["moe"]["model"]["class"] == "Qwen3MoeForCausalLM"
    assert r["models"]["dense"]["model"]["class"] == "Qwen3ForCausalLM"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_mode_has_a_row_with_finite_figures(run, kind):
    r, stdout = run
    rows = r["models"][kind]["modes"]
    assert list(rows) == list(MODES)  # in the order the copies were built
    trained = {}
    for name in MODES:
        row = rows[name]
        if name == "dion_resident" and importlib.util.find_spec("dion") is None:
            assert "not importable" in row["skipped"]
            continue
        assert "error" not in row, row["error"]
        trained[name] = row
        # Each round: ITERS iterations synchronized one by one, then ITERS back to back.
        assert len(row["losses"]) == WARMUP + 2 * ROUNDS * ITERS
        assert (
            all(math.isfinite(x) for x in row["losses"]) and row["last_loss"] == row["losses"][-1]
        )
        assert len(row["iter_s"]) == ROUNDS * ITERS and all(t > 0 for t in row["iter_s"])
        assert 0 < row["min_iter_s"] <= row["median_iter_s"] <= row["max_iter_s"]
        assert _finite(row["step_share_s"])
        share = row["median_iter_s"] - rows["no_step"]["median_iter_s"]
        assert row["step_share_s"] == pytest.approx(share, rel=1e-12, abs=1e-15)
        assert len(row["run_s"]) == ROUNDS and all(t > 0 for t in row["run_s"])
        run_share = row["median_run_s"] - rows["no_step"]["median_run_s"]
        assert row["run_share_s"] == pytest.approx(run_share, rel=1e-12, abs=1e-15)
        assert row["phase_ms"] == {} and row["median_phase_ms"] == {}  # CUDA events only
        assert row["b2b_phase_ms"] == {} and row["median_b2b_phase_ms"] == {}
        assert row["peak_allocated_gib"] is None and row["own_peak_gib"] is None  # no GPU
        if name == "no_step":
            assert row["step_share_s"] == 0.0 and row["median_step_ms"] is None
            assert row["first_step_s"] is None and row["graph"] is None
            continue
        assert len(row["step_ms"]) == len(row["host_ms"]) == 2 * ROUNDS * ITERS
        for key in ("median_step_ms", "median_host_ms", "first_step_s", "first_step_host_s"):
            assert _finite(row[key]) and row[key] > 0, key
        # A step lies inside its iteration, or inside its back-to-back block.
        assert max(row["step_ms"]) / 1e3 <= max(row["max_iter_s"], max(row["run_s"]) * ITERS)
        if name in EAGER:  # cuda_graph=False: no graph statistics
            assert row["graph"] is None
        elif name in OURS:  # on the CPU every step is eager, warm-up included
            stats = row["graph"]
            assert (stats["captures"], stats["replays"]) == (0, 0)
            assert stats["eager_steps"] == WARMUP + 2 * ROUNDS * ITERS
        else:
            assert row["graph"] is None
    # Every copy was built from the same seed and sees the same batches: one first loss.
    assert len({row["losses"][0] for row in trained.values()}) == 1
    # An eager twin runs its graphed twin's optimizer: the same losses, bit for bit.
    for eager, graphed in EAGER.items():
        assert rows[eager]["losses"] == rows[graphed]["losses"]
    # Offloaded state lives on the host, the 8-bit codes and scales in fewer bytes.
    assert (
        0
        < rows["ours_offload_int8"]["host_state_gib"]
        < rows["ours_offload_fp32"]["host_state_gib"]
    )
    table = stdout.split(f"\n{kind} (")[1].split("\n\n")[0]
    for name in MODES:
        assert f"| {name} " in table
    # On the CPU the step's time is the host's: each eager figure reads 100%.
    for eager, graphed in EAGER.items():
        row = rows[eager]
        assert row["host_over_step"] == row["median_host_ms"] / row["median_step_ms"] == 1.0
        assert f"\n{eager}: host {row['median_host_ms']:.2f} ms" in table
        assert f"(graphed, {graphed}: host " in table


def test_a_share_ahead_mode_stages_that_share_of_its_state_with_the_same_losses(tmp_path):
    """``ours_offload_fp32_third`` sets ``prefetch_bytes`` to a third of its streamed state
    after the first warm-up iteration: its arena holds at least that, and its losses are those
    of the default's, bit for bit (staging moves bytes, not results)."""
    out = tmp_path / "third.json"
    cmd = [sys.executable, str(ROOT / "bench" / "training_loop.py"), "--tiny", "--layers", "1"]
    cmd += ["--models", "moe", "--modes", "ours_offload_fp32", "ours_offload_fp32_third"]
    cmd += ["--device", "cpu", "--warmup", "2", "--rounds", "1", "--iters", "1"]
    cmd += ["--json", str(out)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["models"]["moe"]["modes"]
    default, third = rows["ours_offload_fp32"], rows["ours_offload_fp32_third"]
    assert default["prefetch_bytes"] is None
    state = third["host_state_gib"] * (1 << 30)
    assert third["host_state_gib"] == default["host_state_gib"] > 0
    assert third["prefetch_bytes"] == int(state / 3)
    assert third["staging_gib"] * (1 << 30) >= third["prefetch_bytes"]
    assert third["losses"] == default["losses"]


def test_phase_lines_set_each_mode_after_the_clip_against_dions():
    from _bench_import import import_bench

    (report,) = import_bench("training_loop_report")
    rows = {
        "no_step": {"median_phase_ms": {"forward": 100.0, "after clip": 1.0}},
        "ours_offload_int8": {
            "median_phase_ms": {"forward": 101.0, "after clip": 51.0},
            "median_b2b_phase_ms": {"forward": 131.5},
        },
        "dion_resident": {"median_phase_ms": {"forward": 99.0, "after clip": 101.0}},
        "torch_adamw": {"median_iter_s": 0.3},  # no phases (a CPU run): no line
    }
    lines = report.phase_lines(rows)
    assert len(lines) == 3 and lines[0].startswith("no_step: device ms: forward 100.0")
    assert "after clip 51.0; back to back: forward 131.5;" in lines[1]
    assert lines[1].endswith("; after clip / dion_resident's: 0.500")
    assert "/" not in lines[0] and "/" not in lines[2]
