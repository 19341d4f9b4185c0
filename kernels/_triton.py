"""Triton for the kernel modules, or a stand-in where it is not installed.

Triton ships for Linux only, and only CUDA tensors need it: on the CPU the optimizers run the
torch references that sit beside each kernel. The stand-in lets a kernel module define its
kernels without Triton, so that the package imports and its CPU path runs anywhere torch
does; launching one of its kernels raises. A Triton that is installed but fails to import is
not hidden: that error propagates.
"""

from __future__ import annotations

import types

MISSING = (
    "Triton is not installed: the fused kernels (the path for CUDA tensors) need it "
    "(`pip install triton`, Linux only); backend='torch' runs the torch references instead"
)

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as error:
    if error.name != "triton":
        raise

    class _Kernel:
        """A ``@triton.jit`` function without Triton: defined, never launched."""

        def __init__(self, fn):
            self.fn = fn
            self.__name__ = fn.__name__

        def __getitem__(self, grid):
            raise RuntimeError(f"{MISSING} (kernel {self.__name__})")

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"{MISSING} (kernel {self.__name__})")

    class _Constexpr:
        """``tl.constexpr`` as an annotation and as a wrapped module constant."""

        def __init__(self, value=None):
            self.value = value

    triton = types.SimpleNamespace(
        __version__=None,
        # ``@triton.jit`` and ``@triton.jit(do_not_specialize=...)`` alike
        jit=lambda fn=None, **_: _Kernel(fn) if fn is not None else _Kernel,
        cdiv=lambda a, b: -(-a // b),
        next_power_of_2=lambda n: 1 << max(int(n) - 1, 0).bit_length(),
    )
    tl = types.SimpleNamespace(constexpr=_Constexpr)

AVAILABLE = triton.__version__ is not None

__all__ = ["AVAILABLE", "MISSING", "tl", "triton"]
