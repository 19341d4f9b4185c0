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

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)


@pytest.fixture
def cuda_device():
    return torch.device("cuda")
