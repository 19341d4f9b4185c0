"""``muon-offload bench`` end to end on the tiny workload (CPU), and its argument errors."""

import importlib.util
import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from muon_offload.tools import cli
from muon_offload.tools.bench.modes import run_modes
from muon_offload.tools.bench.timing import Clock
from muon_offload.tools.workloads import ParamSpec

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
HAS_DION = importlib.util.find_spec("dion") is not None
OURS = (
    "ours_resident",
    "ours_offload_fp32",
    "ours_offload_bf16",
    "ours_offload_int8",
    "all_at_once",
)
NEEDS_NO_GPU = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the bench on a machine without a GPU"
)
TIMED = ("median_s", "min_s", "max_s", "steps", "peak_added_gib", "to_floor", "to_dion")


def _bench(*args, env=None, timeout=120):
    cmd = [sys.executable, "-m", "muon_offload.tools.cli", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = _bench("--workload", "tiny", "--device", "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out, proc, json.loads((out / "bench.json").read_text())


def test_json_holds_every_mode(tiny_run):
    _, _, r = tiny_run
    for key in ("card", "driver", "torch", "triton", "dion_commit", "date", "args"):
        assert key in r["info"]
    assert r["info"]["args"]["workload"] == "tiny"
    assert r["bandwidth_gbps"] is None and "no CUDA GPU" in r["bandwidth_note"]
    assert r["floor"]["fp32"]["floor_s"] is None
    assert r["floor"]["bf16"]["state_gib"] == pytest.approx(r["floor"]["fp32"]["state_gib"] / 2)
    for mode in OURS:
        assert set(TIMED) <= set(r[mode]), mode
        assert 0 < r[mode]["min_s"] <= r[mode]["median_s"] <= r[mode]["max_s"]
        assert r[mode]["steps"] == 7 and r[mode]["peak_added_gib"] is None
    assert r["ours_resident_int8"]["median_s"] > 0  # in the main run only
    for mode in ("ours_offload_fp32", "ours_offload_bf16", "ours_offload_int8", "all_at_once"):
        assert r[mode]["host_state_gib"] > 0 and r[mode]["floor_s"] is None, mode
    # 8-bit state's floor is set by the bytes the optimizer holds (tests/test_bench_modes.py
    # checks them against the state format).
    assert r["floor"]["int8"]["state_gib"] == r["ours_offload_int8"]["host_state_gib"]
    assert r["floor"]["int8"]["state_gib"] < r["ours_offload_bf16"]["host_state_gib"]
    for peer in ("torch_adamw_fused", "torchao_offload"):
        assert "not applicable" in r[peer]["skipped"]
    dion = r["dion_resident"]
    if HAS_DION:
        assert dion["median_s"] > 0 and dion["all_at_once"]["median_s"] > 0
        assert r["ours_resident"]["to_dion"] == pytest.approx(
            r["ours_resident"]["median_s"] / dion["median_s"]
        )
    else:
        assert "not installed" in dion["skipped"]
    for key in ("chunk_sweep", "chunk_sweep_bf16"):
        assert len(r[key]) == 3 and all(v["median_s"] > 0 for v in r[key].values())
    sd = r["state_dict"]
    assert sd["state_bytes"] == round(r["floor"]["fp32"]["state_gib"] * 2**30)
    assert sd["call_s"] > 0 and sd["read_through_state_dict_s"] > 0 and sd["read_slabs_s"] > 0
    assert sd["peak_added_bytes"] is None  # no GPU here
    stages = {row["stage"] for row in r["timeline_fp32"]}
    assert stages == {"load", "update", "store"}  # on the CPU too, one after another
    assert len({row["chunk"] for row in r["timeline_fp32"]}) > 1
    memory = r["memory_by_layers"]
    assert list(memory) == ["2", "4", "8"]
    sizes = [m["state_gib"] for m in memory.values()]
    assert sizes == sorted(sizes)
    for m in memory.values():
        assert all(m["modes"][mode]["median_s"] > 0 for mode in OURS)
        assert ("dion_resident" in m["modes"]) == HAS_DION


def test_table_and_figures(tiny_run):
    out, proc, r = tiny_run
    labels = ("ours resident", "ours offload fp32", "ours offload bf16", "ours offload int8")
    for label in (*labels, "ours resident int8", "all-at-once", "host GiB", "int8 (codes"):
        assert label in proc.stdout
    assert ("dion resident" if HAS_DION else "dion is not installed") in proc.stdout
    assert "not measured" in proc.stdout
    assert "tiny 2 layers: ours_resident" in proc.stderr  # the progress lines
    if HAS_MPL:
        for name in ("timeline.png", "state_size.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in r["figures"]["skipped"]


def test_without_matplotlib_or_dion(tmp_path):
    """A ``matplotlib`` that fails to import: the figures are skipped, not the run."""
    (tmp_path / "matplotlib.py").write_text("raise ImportError('hidden for the test')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    args = (
        "--memory-layers",
        "1",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--no-dion",
        "--chunk-mib",
        "0.0625",
        "--out",
        str(tmp_path / "r.json"),
    )
    proc = _bench(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    assert "matplotlib is not installed" in r["figures"]["skipped"]
    assert "matplotlib is not installed" in proc.stdout
    assert r["dion_resident"] == {"skipped": "left out (--no-dion)"}
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workload", "nope"], "invalid choice: 'nope'"),
        (["--layers", "0"], "muon-offload bench: error: --layers must be >= 1, got 0"),
        (["--memory-layers", "12", "0"], "--memory-layers must be >= 1"),
        (["--workload", "qwen3-30b-a3b-ep8-rank", "--layers", "49"], "has 48 layers"),
        (["--dion-path", "/nonexistent"], "no dion/__init__.py"),
        pytest.param(["--offload-only"], "no CUDA GPU", marks=NEEDS_NO_GPU),
        pytest.param(["--device", "cuda"], "no CUDA GPU", marks=NEEDS_NO_GPU),
    ],
)
def test_argument_errors(args, message, tmp_path, capsys):
    """How ``python -m muon_offload.tools.cli`` ends (tiny_run runs that entry): argparse's
    exit, status 2, usage and the error on stderr, nothing on stdout; a traceback there would
    be an exception other than SystemExit here."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *args, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert message in err and err.startswith("usage: muon-offload bench")
    assert not out
    assert not (tmp_path / "bench.json").exists()


def test_torch_fused_adamw_on_adamw_only_workload():
    specs = [ParamSpec("a", (300,), "adamw"), ParamSpec("b", (17, 40), "adamw")]
    args = Namespace(device="cpu", offload_only=False, chunk_bytes=1024, chunk_mib=[])
    clock = Clock(torch.device("cpu"))
    r = run_modes(specs, args, clock, lambda stage: None, warmup=1, steps=2, full=False)
    for mode in (*OURS, "torch_adamw_fused"):
        assert r[mode]["median_s"] > 0 and r[mode]["steps"] == 2
