"""Test configuration. With no GPU, Triton kernels run under the interpreter: the variable
must be set before any module that defines a ``@triton.jit`` function is imported, so it is
set here, at collection start, and nothing above imports a kernel module."""

import os


def _has_cuda_gpu() -> bool:
    import torch  # torch defines no Triton kernels, so importing it first is safe

    return torch.cuda.is_available()


def _squeeze_loaded_scalars_in_old_interpreters() -> None:
    """triton 3.6's interpreter turns a loaded scalar (a 1-element array there) into a Python
    int with ``int(array)``, which numpy >= 2.3 refuses: every kernel whose loop count comes
    from a load fails. triton 3.9 squeezes the array first; do the same where it does not.
    Tests only: compiled kernels never take this path."""
    import inspect

    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or "squeeze" in inspect.getsource(patch):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if not _has_cuda_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _squeeze_loaded_scalars_in_old_interpreters()

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
