"""Test configuration. With no GPU, Triton kernels run under the interpreter: the variable
must be set before any module that defines a ``@triton.jit`` function is imported, so it is
set here, at collection start, and nothing above imports a kernel module."""

import os
import sys
from pathlib import Path

# The checkout's root holds ``kernels/``, which installs as ``muon_offload.kernels`` only.
# ``python -m pytest`` puts the working directory first on sys.path, where that folder would
# be importable as a top-level ``kernels`` and shadow PyPI's ``kernels``, which transformers
# imports when it is installed (a dependency of transformers from 5.25): its Trainer then
# failed with "cannot import name 'CUDAProperties' from 'kernels'". Nothing is imported from
# the root itself (the package is installed; tests/ and bench/ are added on their own).
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]

# One CPU thread a process for torch's operations: the suite runs a worker per core (-n auto)
# and spawns ranks and scripts beside them, and two threads a process contend on every small
# operation (a 24 x 40 batched product: 0.03 ms on one thread, 7.9 ms on two against another
# worker). Set before torch is imported, so the processes the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda_gpu() -> bool:
    import torch  # torch defines no Triton kernels, so importing it first is safe

    return torch.cuda.is_available()


if not _has_cuda_gpu():
    # muon_offload.kernels then fixes triton 3.6's interpreter under new numpy (_interpreter.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The interpreter's per-call walk for the builtins to wrap, done once (_interpreter_speed.py).
    from _interpreter_speed import cache_builtin_names

    cache_builtin_names()

import pytest  # noqa: E402
import torch  # noqa: E402

# Where torch was imported before this file (a plugin), the variable came too late for it.
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The tests of the surfaces where torch and Triton versions differ: Triton's interpreter and
# compiler (the kernels, their compile check and tuning, the private launcher and compile APIs
# that precompiling uses), torch's distributed, DTensor and checkpoint APIs, the dispatch hooks
# the CPU stand-in of a CUDA graph records through, torch.optim.Optimizer's protocol and torch's
# AdamW, transformers' Trainer on torch. CI runs these under every stack it tests (.ci/run:
# -m stacks) and the rest, the engine's own logic over tensors and the tools around it, under
# one: a test of one of these surfaces goes in a file named so.
VERSION_SURFACES = (
    "test_kernels_",
    "test_kernel_variants",
    "test_precompile",
    "test_first_compile",
    "test_launch_caches",
    "test_int8_state",
    "test_without_triton",
    "test_math",
    "test_distributed",
    "test_graph_mesh",
    "test_rank_agreement",
    "test_gpu_",
    "test_checkpoints",
    "test_dion_interchange",
    "test_cuda_graph",
    "test_graph_ends",
    "test_graph_fresh_grads",
    "test_optimizer_api",
    "test_vs_torch_adamw",
    "test_transformers.py",
)

# The longest single test (it compiles every kernel variant on a pool of its own): started
# first, so that the rest of the suite runs beside it rather than after it.
FIRST = "test_kernels_compile.py"


# Bench scripts set TORCHDYNAMO_DISABLE when imported (their runs are eager); torch._dynamo reads
# it when first imported, so a value left behind would turn torch.compile off for the tests
# that follow in the same worker. Put back after collection and after every test.
_DYNAMO_ENV = os.environ.get("TORCHDYNAMO_DISABLE")


def _restore_dynamo_env() -> None:
    if _DYNAMO_ENV is None:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)
    else:
        os.environ["TORCHDYNAMO_DISABLE"] = _DYNAMO_ENV


def pytest_collection_finish(session):
    _restore_dynamo_env()


@pytest.fixture(autouse=True)
def _dynamo_env_kept():
    yield
    _restore_dynamo_env()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "stacks: tests of what differs between torch and Triton versions"
    )


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if item.path.name.startswith(VERSION_SURFACES):
            item.add_marker(pytest.mark.stacks)
    items.sort(key=lambda item: item.path.name != FIRST)  # stable: the rest keep their order


@pytest.fixture
def cuda_device():
    return torch.device("cuda")
