"""Test configuration. With no GPU, Triton kernels run under the interpreter: the variable
must be set before any module that defines a ``@triton.jit`` function is imported, so it is
set here, at collection start, and nothing above imports a kernel module."""

import os


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

# Tests of the tools around the optimizers (bench scripts, the CLI, the docs' snippets, the
# package layout): what they check does not change with the torch or Triton version, so CI runs
# them under one stack only (.ci/run: -m "not tooling" elsewhere).
TOOLING = (
    "test_bench_",
    "test_docs",
    "test_fsdp2_transformers_bench",
    "test_layout",
    "test_multi_gpu_bench",
    "test_packaging",
    "test_resident_vs_dion_script",
    "test_tools_cli",
    "test_train_compare",
    "test_transformers_bench",
)


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
    config.addinivalue_line("markers", "tooling: tests of the bench scripts, CLI, docs, layout")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if item.path.name.startswith(TOOLING):
            item.add_marker(pytest.mark.tooling)


@pytest.fixture
def cuda_device():
    return torch.device("cuda")
