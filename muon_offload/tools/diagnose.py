"""``python -m muon_offload``: what this install runs on, and whether it works here.

Prints the versions (muon-offload, Python and the platform, torch, Triton), the GPUs CUDA sees
with their compute capability, then runs one small optimizer step: on a GPU with the Triton
kernels (compiled on first use) and checked against the torch path on the same inputs, on the
CPU with the torch path. Each line is OK, FAILED with its error, or SKIPPED with why; the exit
status is 1 when a line FAILED. A few seconds on a CPU.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

USAGE = """usage: python -m muon_offload

Prints the versions of muon-offload, Python, torch and Triton, the GPUs CUDA sees, and whether
one small optimizer step runs here (the Triton kernels on a GPU, the torch path on the CPU).
Exit status 1 when a check failed."""
# The Triton step's update may differ from the torch path's by bf16 rounding in the
# orthogonalization (a few parts in a thousand); a broken kernel differs by far more.
UPDATE_RTOL = 0.05


class Report:
    """The lines printed so far and whether one failed."""

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.failed = 0

    def line(self, status: str, text: str) -> None:
        self.failed += status == "FAILED"
        print(f"{status:<8}{text}", file=self.out, flush=True)

    def check(self, what: str, run: Callable[[], str | None]) -> bool:
        """``run()``'s detail after OK, or its error after FAILED; True if it passed."""
        try:
            detail = run()
        except Exception as error:  # the point is to report any failure, not to stop at it
            self.failure(what, error)
            return False
        self.line("OK", f"{what}{': ' + detail if detail else ''}")
        return True

    def failure(self, what: str, error: BaseException) -> None:
        """A FAILED line: the error's type, its first line and where it was raised."""
        frame = traceback.extract_tb(error.__traceback__)[-1]
        message = (str(error).strip().splitlines() or [""])[0]
        where = f"{Path(frame.filename).name}:{frame.lineno}"
        self.line("FAILED", f"{what}: {type(error).__name__}: {message} ({where})")


def _package() -> str:
    import muon_offload

    where = Path(muon_offload.__file__).parent
    try:
        installed = importlib.metadata.version("muon-offload")
    except importlib.metadata.PackageNotFoundError:
        return f"{muon_offload.__version__} (not installed: imported from {where})"
    if installed != muon_offload.__version__:
        raise RuntimeError(
            f"imported {muon_offload.__version__} from {where}, but {installed} is installed"
        )
    return f"{muon_offload.__version__} ({where})"


def _python() -> str:
    version, implementation = platform.python_version(), platform.python_implementation()
    return f"{version} ({implementation}) on {platform.platform()}"


def _optimizers() -> None:
    from muon_offload import AdamW, Muon  # noqa: F401  (the engine and kernel modules)


def _torch() -> str:
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    return f"{torch.__version__} ({build} build)"


def _triton(report: Report, cuda: bool) -> bool:
    """The Triton line; True if Triton imports."""
    try:
        import triton
    except ModuleNotFoundError as error:
        if error.name != "triton":
            report.failure("triton", error)
            return False
        if cuda:
            report.line("FAILED", "triton: not installed; the GPU path needs it (Linux only)")
        else:
            report.line("SKIPPED", "triton: not installed (only the GPU path needs it)")
        return False
    except Exception as error:  # installed but broken: the kernels' import fails the same way
        report.failure("triton", error)
        return False
    report.line("OK", f"triton: {triton.__version__}")
    return True


def _gpus() -> str:
    import torch

    names = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        names.append(
            f"cuda:{i} {torch.cuda.get_device_name(i)}, compute capability {major}.{minor}"
        )
    return "; ".join(names)


def _tiny_step(device, backend: str, offload: bool):
    """One Muon step (two matrices) with an AdamW group (a bias), from fixed inputs: the
    parameters before and after."""
    import torch

    from muon_offload import Muon

    gen = torch.Generator().manual_seed(0)
    shapes = [(96, 64), (64, 160), (160,)]
    params = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    before = [p.detach().clone() for p in params]
    groups = [dict(params=params[:2]), dict(params=params[2:], algorithm="adamw", lr=1e-2)]
    opt = Muon(groups, lr=0.02, offload=offload, backend=backend, cuda_graph=False)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    return before, [p.detach() for p in params]


def _check_step(device, backend: str, offload: bool) -> str:
    import torch

    start = time.perf_counter()
    before, after = _tiny_step(device, backend, offload)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    for b, a in zip(before, after, strict=True):
        if not torch.isfinite(a).all():
            raise RuntimeError("the step wrote a non-finite value")
        if torch.equal(a, b):
            raise RuntimeError(f"the step left a {tuple(a.shape)} parameter unchanged")
    return f"{seconds:.2f} s"


def _check_against_torch(device) -> str:
    """The Triton step's update against the torch path's, on the same inputs."""
    before, fused = _tiny_step(device, "triton", offload=True)
    _, reference = _tiny_step(device, "torch", offload=True)
    worst = 0.0
    for b, f, r in zip(before, fused, reference, strict=True):
        rel = float((f - r).norm() / (r - b).norm())
        worst = max(worst, rel)
        if not rel <= UPDATE_RTOL:
            raise RuntimeError(
                f"a {tuple(b.shape)} parameter's update is {rel:.2g} away from the torch path's"
                f" (relative norm; at most {UPDATE_RTOL} expected)"
            )
    return f"updates within {worst:.1e} of the torch path's (relative norm)"


def run_checks(report: Report) -> None:
    """Every line, in order; stops where nothing after could run."""
    report.check("muon-offload", _package)
    report.check("python", _python)
    if not report.check("torch", _torch):
        return
    import torch

    cuda = torch.cuda.is_available()
    has_triton = _triton(report, cuda)
    if cuda:
        report.check(f"CUDA {torch.version.cuda}", _gpus)
    else:
        why = "a CPU build of torch" if not torch.version.cuda else "no GPU visible"
        report.line("SKIPPED", f"CUDA: not available ({why}): the CPU path")
    if not report.check("import the optimizers (Muon, AdamW)", _optimizers):
        return
    cpu = torch.device("cpu")
    report.check("optimizer step on cpu (torch path)", lambda: _check_step(cpu, "torch", False))
    if not cuda:
        report.line("SKIPPED", "Triton kernels: no CUDA GPU (the CPU runs the torch path)")
        return
    if not has_triton:
        return
    gpu = torch.device("cuda", torch.cuda.current_device())
    if report.check(
        f"Triton kernels compile and an offloaded step runs on {gpu}",
        lambda: _check_step(gpu, "triton", True),
    ):
        report.check("Triton step against the torch path", lambda: _check_against_torch(gpu))


def main(argv: list[str] | None = None, out=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    report = Report(out)
    if argv:
        print(USAGE, file=report.out)
        return 0 if argv[0] in ("-h", "--help") else 2
    run_checks(report)
    summary = f"{report.failed} check(s) FAILED" if report.failed else "all checks passed"
    print(summary, file=report.out)
    return 1 if report.failed else 0
