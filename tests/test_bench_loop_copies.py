"""bench/loop_copies.py: the summary of a trace's copies (streams, bytes, the loads' stalls and
the stores that ended just before each), on made-up trace events; and the script's run on the
CPU (no copies there: an empty summary, the file written)."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

from _bench_import import import_bench

ROOT = Path(__file__).resolve().parents[1]
(loop_copies,) = import_bench("loop_copies")


def _copy(name, ts, dur, stream, nbytes):
    args = {"stream": stream, "bytes": nbytes}
    return {"cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur, "args": args}


H2D, D2H = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"


def test_streams_bytes_and_the_loads_stalls_with_the_stores_before_them():
    events = [
        {"cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 5000.0, "args": {"stream": 7}},
        _copy(H2D, 100.0, 400.0, 20, 1000),  # loads on stream 20: 100-500
        _copy(H2D, 700.0, 300.0, 20, 2000),  # a 0.2 ms gap: no stall
        _copy(D2H, 900.0, 2000.0, 21, 5000),  # a store 900-2900 on stream 21
        _copy(D2H, 3400.0, 1000.0, 21, 50),  # ends last (4400), starts before the last load
        _copy(D2H, 2500.0, 100.0, 22, 64),  # the side lane's, 2500-2600 (0.9 ms before)
        _copy(H2D, 3500.0, 500.0, 20, 3000),  # 2.5 ms after the last load: a stall
        _copy("Memcpy DtoD (Device -> Device)", 4200.0, 10.0, 7, 8),
    ]
    out = loop_copies.summarize(events, gap_ms=1.0, before_ms=0.7)
    assert out["copies"] == 7 and out["window_ms"] == 4.3
    assert out["streams"]["20"]["HtoD"] == {"bytes": 6000, "busy_ms": 1.2}
    assert out["streams"]["21"]["DtoH"]["bytes"] == 5050 and out["streams"]["7"]["DtoD"]["bytes"]
    (stall,) = out["load_stalls"]
    assert stall == {
        "at_ms": 0.9,
        "ms": 2.5,
        "stream": 20,
        "next_load_bytes": 3000,
        "stores_just_before": [{"stream": 21, "bytes": 5000, "ended_ms_before": 0.6}],
    }
    assert out["load_stall_ms"] == 2.5
    assert loop_copies.summarize([]) == {
        "copies": 0,
        "window_ms": 0.0,
        "streams": {},
        "load_stalls": [],
        "load_stall_ms": 0,
    }


def test_the_script_runs_on_the_cpu_and_writes_its_summary(tmp_path):
    out = tmp_path / "copies.json"
    cmd = [sys.executable, str(ROOT / "bench" / "loop_copies.py"), "--mode", "ours_offload_fp32"]
    cmd += ["--tiny", "--device", "cpu", "--iters", "1", "--warmup", "1", "--json", str(out)]
    cmd += ["--trace", str(tmp_path / "trace.json.gz")]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "ours_offload_fp32" and result["copies"] == 0
    assert result["info"]["command"].startswith("bench/loop_copies.py --mode ours_offload_fp32")
    assert "0 load stalls" in proc.stdout
    assert len(result["step_ms"]) == 1 and len(result["iter_s"]) == 1
    with gzip.open(tmp_path / "trace.json.gz", "rt") as f:
        kept = json.load(f)["traceEvents"]
    assert all(e.get("cat") in loop_copies.DEVICE_SIDE or e.get("ph") == "M" for e in kept)
