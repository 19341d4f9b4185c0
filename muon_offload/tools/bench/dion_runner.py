"""dion's ``Muon`` for the bench: where dion is, which commit, and its modes timed in a
subprocess (``python -m muon_offload.tools.bench.dion_runner JOB``), so that its imports and memory
stay out of ours. dion runs eagerly (torch.compile off): its compiled step never finished a
first step on the H200 (docs/benchmarks.md, "Workloads")."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import torch

from ..workloads import workload
from .modes import MUON_LR, AllAtOnce, build
from .timing import Clock, time_steps


def find_dion(path: str | None) -> tuple[str | None, str | None]:
    """(the folder that holds the ``dion`` package, None) or (None, why dion is not run)."""
    if path:
        if not os.path.isfile(os.path.join(path, "dion", "__init__.py")):
            raise FileNotFoundError(f"--dion-path {path}: no dion/__init__.py there")
        return os.path.abspath(path), None
    spec = importlib.util.find_spec("dion")
    if spec is None or spec.origin is None:
        return None, (
            "dion is not installed; it is not on PyPI: pip install "
            '"git+https://github.com/microsoft/dion@0a059a4" (the commit compared against), '
            "or pass --dion-path DIR"
        )
    return os.path.dirname(os.path.dirname(spec.origin)), None


def dion_commit(root: str) -> str | None:
    if os.environ.get("DION_COMMIT"):
        return os.environ["DION_COMMIT"]
    if not os.path.exists(os.path.join(root, ".git")) or shutil.which("git") is None:
        return None
    proc = subprocess.run(
        ["git", "-C", root, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True
    )
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def run_dion(args, root: str, runs: list[dict]) -> list[dict]:
    """dion's resident and all-at-once modes for each of ``runs`` (layers, warmup, steps), in a
    subprocess; a failure is an ``error`` entry per run, not an exception."""
    env = dict(
        os.environ,
        TORCHDYNAMO_DISABLE="1",
        PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    )
    job = dict(workload=args.workload, device=args.device, threads=args.threads, runs=runs)
    cmd = [sys.executable, "-m", "muon_offload.tools.bench.dion_runner", json.dumps(job)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return [{"error": "dion did not finish within 30 minutes"} for _ in runs]
    if proc.returncode != 0:
        return [{"error": proc.stderr[-2000:]} for _ in runs]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker(job: dict) -> None:
    """The subprocess: each run's figures, as one JSON line on stdout."""
    import dion

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    clock = Clock(device)
    results = []
    for run in job["runs"]:
        groups, _, base = build(workload(job["workload"], run["layers"]), device)
        opt = dion.Muon(groups, lr=MUON_LR)
        r = time_steps(opt.step, clock, run["warmup"], run["steps"], base)

        baseline = AllAtOnce(opt, ("momentum", "variance"), pin=clock.cuda)
        r["all_at_once"] = time_steps(baseline.step, clock, 1, run["steps"], base)
        results.append(r)
        del opt, groups, baseline
        clock.free()
    print(json.dumps(results))


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
