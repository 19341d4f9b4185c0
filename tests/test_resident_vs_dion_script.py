"""bench/resident_vs_dion.py end to end on the tiny workload (CPU): every optimizer steps once
per round, and each round's ratio is ours / dion's of that round."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_interleaved_rounds_and_ratios(tmp_path):
    dion = pytest.importorskip(
        "dion",
        reason='needs dion, which is not on PyPI: pip install "git+https://github.com/microsoft/dion@0a059a4"',
    )
    dion_root = Path(dion.__file__).resolve().parents[1]
    out = tmp_path / "rvd.json"
    cmd = [sys.executable, str(ROOT / "bench" / "resident_vs_dion.py"), "--dion-path"]
    cmd += [str(dion_root), "--workload", "tiny", "--out", str(out), "--rounds", "3"]
    cmd += ["--warmup", "1", "--chunk-mib", "1", "4", "--gram-newton-schulz"]
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r["median_ratio_to_dion"]) == {"ours_1mib", "ours_4mib", "ours_gns"}
    for name in ("ours_1mib", "ours_4mib", "ours_gns", "dion"):
        steps = r[name]["steps"]
        assert len(steps) == 3 and all(0 < s["host_s"] <= s["s"] for s in steps)
    for name in ("ours_1mib", "ours_4mib", "ours_gns"):
        pairs = zip(r[name]["steps"], r["dion"]["steps"], strict=True)
        expected = [o["s"] / d["s"] for o, d in pairs]
        assert r["ratios"][name] == pytest.approx(expected, rel=1e-12)
        assert sorted(expected)[1] == pytest.approx(r["median_ratio_to_dion"][name], rel=1e-12)
