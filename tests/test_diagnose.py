"""``python -m muon_offload``: the versions, the device, a small step on the CPU's torch path
(and on a GPU the Triton kernels, against the torch path), each line OK / FAILED / SKIPPED, a
non-zero exit status when something failed; without Triton the CPU path still passes."""

import importlib.util
import io
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import muon_offload
from muon_offload.tools import diagnose

ROOT = Path(__file__).resolve().parents[1]
STATUSES = ("OK", "FAILED", "SKIPPED")


def _python(code: str, cpu: bool = True) -> subprocess.CompletedProcess:
    """``python -c code`` in the environment a user runs the diagnostic in."""
    path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    env.pop("TRITON_INTERPRET", None)  # as a user runs it
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a machine with GPUs
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )


def _diagnose(cpu: bool = True) -> subprocess.CompletedProcess:
    return _python("import runpy; runpy.run_module('muon_offload', run_name='__main__')", cpu)


# The CPU runs fork from one interpreter that imported torch (which imports no Triton:
# checked), each set up as its own fresh interpreter was (Triton hidden, or a broken one
# first on the path) before anything of the package is imported: each starts as a user's
# ``python -m muon_offload`` does, less torch's import (seconds of CPU each).
FORKED_RUNS = """
import os, runpy, sys, traceback
import torch
assert "triton" not in sys.modules, "torch imported Triton: a run without it would see it"
for hide, path, out in RUNS:
    pid = os.fork()
    if pid == 0:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        os.dup2(os.open(out + ".out", flags), 1)
        os.dup2(os.open(out + ".err", flags), 2)
        code = 1
        try:
            if hide:
                sys.modules["triton"] = None
            if path:
                sys.path.insert(1, path)
            runpy.run_module("muon_offload", run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(out + ".rc", "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The CPU runs by name: as installed, without Triton, with a broken Triton."""
    tmp = tmp_path_factory.mktemp("diagnose")
    (tmp / "broken" / "triton").mkdir(parents=True)
    (tmp / "broken" / "triton" / "__init__.py").write_text(
        'raise ImportError("a broken install")\n'
    )
    runs = {
        "installed": (False, None),
        "no_triton": (True, None),
        "broken_triton": (False, str(tmp / "broken")),
    }
    spec = [(hide, path, str(tmp / name)) for name, (hide, path) in runs.items()]
    proc = _python(f"RUNS = {spec!r}\n" + FORKED_RUNS)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return {
        name: subprocess.CompletedProcess(
            name,
            int((tmp / f"{name}.rc").read_text()),
            (tmp / f"{name}.out").read_text(),
            (tmp / f"{name}.err").read_text(),
        )
        for name in runs
    }


def _lines(stdout: str) -> dict[str, str]:
    """Each check's line, keyed by its name (the text before its first colon)."""
    *checks, summary = stdout.strip().splitlines()
    assert all(line.split()[0] in STATUSES for line in checks), stdout
    return {line[8:].split(":")[0]: line for line in checks} | {"summary": summary}


def test_on_the_cpu_every_check_passes_and_names_the_versions(cpu_runs):
    proc = cpu_runs["installed"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = _lines(proc.stdout)
    assert (
        lines["muon-offload"].startswith("OK") and muon_offload.__version__ in lines["muon-offload"]
    )
    assert platform.python_version() in lines["python"] and platform.system() in lines["python"]
    assert lines["torch"].startswith("OK") and torch.__version__ in lines["torch"]
    if importlib.util.find_spec("triton") is not None:
        import triton

        assert lines["triton"] == f"OK      triton: {triton.__version__}"
    assert lines["CUDA"].startswith("SKIPPED") and "not available" in lines["CUDA"]
    assert lines["optimizer step on cpu (torch path)"].startswith("OK")
    assert lines["Triton kernels"].startswith("SKIPPED")
    assert lines["summary"] == "all checks passed"


def test_without_triton_the_cpu_path_passes(cpu_runs):
    proc = cpu_runs["no_triton"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = _lines(proc.stdout)
    assert lines["triton"] == "SKIPPED triton: not installed (only the GPU path needs it)"
    assert lines["optimizer step on cpu (torch path)"].startswith("OK")


def test_a_broken_triton_fails_with_its_error(cpu_runs):
    proc = cpu_runs["broken_triton"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    lines = _lines(proc.stdout)
    assert lines["triton"].startswith("FAILED  triton: ImportError: a broken install")
    failed = lines["import the optimizers (Muon, AdamW)"]
    assert failed.startswith("FAILED") and "a broken install" in failed
    assert lines["summary"] == "2 check(s) FAILED"


def test_a_failing_step_is_reported_with_its_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no step today\nsecond line")

    monkeypatch.setattr(diagnose, "_tiny_step", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = io.StringIO()
    assert diagnose.main([], out=out) == 1
    line = _lines(out.getvalue())["optimizer step on cpu (torch path)"]
    assert line.startswith(
        "FAILED  optimizer step on cpu (torch path): RuntimeError: no step today"
    )
    assert "second line" not in line and "test_diagnose.py" in line


def test_usage():
    out = io.StringIO()
    assert diagnose.main(["--help"], out=out) == 0 and out.getvalue().startswith("usage: ")
    assert diagnose.main(["--bogus"], out=io.StringIO()) == 2


@pytest.mark.cuda
def test_on_a_gpu_the_triton_kernels_run_and_match_the_torch_path():
    proc = _diagnose(cpu=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = _lines(proc.stdout)
    assert lines[f"CUDA {torch.version.cuda}"].startswith("OK")
    assert "compute capability" in lines[f"CUDA {torch.version.cuda}"]
    assert any(
        k.startswith("Triton kernels compile") and v.startswith("OK") for k, v in lines.items()
    )
    assert lines["Triton step against the torch path"].startswith("OK")
