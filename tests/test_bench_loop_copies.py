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


def _copy(name, ts, dur, stream, nbytes, correlation=0):
    args = {"stream": stream, "bytes": nbytes, "correlation": correlation}
    return {"cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur, "args": args}


def _launch(ts, correlation):
    args = {"correlation": correlation}
    return {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5.0, "args": args}


H2D, D2H = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"


def test_streams_and_each_steps_copies_kernels_and_load_stalls_with_the_stores_before_them():
    """Work belongs to a step by the correlation id of the runtime call that queued it inside
    the step's profiler range, whatever stream ran it (a graph's nodes run on streams of
    their own); the loads' stalls are gaps between loads on any stream."""
    step = {"cat": "user_annotation", "name": "Optimizer.step#Muon.step", "ts": 50.0, "dur": 90}
    events = [
        step,
        _launch(60.0, 1),  # inside the step's range: correlation 1 is the step's
        _launch(200.0, 2),  # after it (a hook's copy under the next backward)
        {"cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 5000.0, "args": {"correlation": 1}},
        _copy(H2D, 100.0, 400.0, 20, 1000, 1),  # the step's loads on stream 20: 100-500
        _copy(H2D, 700.0, 300.0, 21, 2000, 1),  # on stream 21 after a 0.2 ms gap: no stall
        _copy(D2H, 900.0, 2000.0, 22, 5000, 1),  # a store 900-2900
        _copy(D2H, 3400.0, 1000.0, 22, 50, 1),  # ends last (4400), starts before the last load
        _copy(D2H, 2500.0, 100.0, 23, 64, 2),  # not the step's, 2500-2600 (0.9 ms before)
        _copy(H2D, 3500.0, 500.0, 20, 3000, 1),  # 2.5 ms after the last load: a stall
        _copy(H2D, 3600.0, 100.0, 24, 10, 2),  # not the step's
        _copy("Memcpy DtoD (Device -> Device)", 4200.0, 10.0, 7, 8, 1),
    ]
    out = loop_copies.summarize(events, gap_ms=1.0, before_ms=0.7)
    assert out["copies"] == 8 and out["window_ms"] == 4.3
    assert out["streams"]["20"]["HtoD"] == {"bytes": 4000, "busy_ms": 0.9}
    assert out["streams"]["22"]["DtoH"]["bytes"] == 5050 and out["streams"]["7"]["DtoD"]["bytes"]
    (mine,) = out["steps"]
    assert mine["span_ms"] == 5.0 and mine["kernels_busy_ms"] == 5.0
    assert mine["HtoD"] == {"bytes": 6000, "busy_ms": 1.2}
    assert mine["DtoH"] == {"bytes": 5050, "busy_ms": 3.0}
    (stall,) = mine["load_stalls"]
    assert stall == {
        "at_ms": 1.0,
        "ms": 2.5,
        "next_load_bytes": 3000,
        "stores_just_before": [{"stream": 22, "bytes": 5000, "ended_ms_before": 0.6}],
    }
    assert mine["load_stall_ms"] == out["load_stall_ms"] == 2.5
    assert loop_copies.summarize([]) == {
        "copies": 0,
        "window_ms": 0.0,
        "streams": {},
        "steps": [],
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
    assert result["steps"] and "load stalls" in proc.stdout  # the CPU step, no copies
    assert len(result["step_ms"]) == 1 and len(result["iter_s"]) == 1
    with gzip.open(tmp_path / "trace.json.gz", "rt") as f:
        kept = json.load(f)["traceEvents"]
    assert all(e.get("cat") in loop_copies.KEPT or e.get("ph") == "M" for e in kept)
