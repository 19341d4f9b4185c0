"""Without Triton (it ships for Linux only), the package imports and its CPU path runs: the
same bits as with Triton installed, where the CPU runs the same torch references. Launching
a kernel then raises an error that names what is missing."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import muon_offload

ROOT = Path(__file__).resolve().parents[1]
# Makes ``import triton`` raise ModuleNotFoundError, as where it is not installed.
NO_TRITON = "import sys; sys.modules['triton'] = None\n"


def train(steps: int = 2) -> dict[str, torch.Tensor]:
    """A few steps of Muon (fp32 and 8-bit state, offloaded) and AdamW on the CPU."""
    out = {}
    for name, make in (
        ("muon_fp32", lambda g: muon_offload.Muon(g, lr=0.02, offload=True)),
        ("muon_int8", lambda g: muon_offload.Muon(g, lr=0.02, state_dtype=torch.int8)),
        ("adamw", lambda g: muon_offload.AdamW([p for d in g for p in d["params"]], lr=1e-2)),
    ):
        gen = torch.Generator().manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(40, 24, generator=gen))
        bias = torch.nn.Parameter(torch.randn(300, generator=gen))
        opt = make([dict(params=[weight]), dict(params=[bias], algorithm="adamw")])
        for _ in range(steps):
            weight.grad = torch.randn(weight.shape, generator=gen)
            bias.grad = torch.randn(bias.shape, generator=gen)
            opt.step()
        out[f"{name}.weight"], out[f"{name}.bias"] = weight.detach(), bias.detach()
    return out


def _run(code: str, triton: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "tests"))))
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a machine with GPUs
    return subprocess.run(
        [sys.executable, "-c", ("" if triton else NO_TRITON) + code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
        check=False,
    )


# One interpreter imports torch (which imports no Triton: checked), then forks a process for
# each run, the first with Triton hidden before anything of the package is imported: each run
# starts as a fresh interpreter would, less torch's import (seconds of CPU each).
FORKED_RUNS = """
import os, sys, traceback
import torch, torch.distributed.tensor
assert "triton" not in sys.modules, "torch imported Triton: a run without it would see it"
for triton, path in RUNS:
    pid = os.fork()
    if pid == 0:
        try:
            if not triton:
                sys.modules["triton"] = None
            import test_without_triton as t
            from muon_offload.kernels import _triton
            assert _triton.AVAILABLE is triton
            torch.save(t.train(), path)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, (triton, status)
"""


def test_the_cpu_path_runs_without_triton(tmp_path):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("compares against a run with Triton installed")
    # both in a process of their own: the CPU path, also beside a GPU
    paths = {triton: str(tmp_path / f"triton_{triton}.pt") for triton in (False, True)}
    proc = _run(f"RUNS = {list(paths.items())!r}\n" + FORKED_RUNS, triton=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {triton: torch.load(path) for triton, path in paths.items()}
    got, want = runs[False], runs[True]
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_a_kernel_launch_without_triton_says_what_is_missing():
    code = (
        "import torch\n"
        "from muon_offload.kernels.elementwise import adamw_\n"
        "p, g, m, v = (torch.zeros(8) for _ in range(4))\n"
        "try:\n"
        "    adamw_([p], [g], [m], [v], lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,\n"
        "           weight_decay=0.0, step=1)\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Triton is not installed" in proc.stdout and "backend='torch'" in proc.stdout
