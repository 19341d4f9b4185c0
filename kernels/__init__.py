"""Fused kernels and the torch references they are tested against.

Installed as ``muon_offload.kernels``. Each module holds one kernel family: its Triton
kernels and typed launchers (used for CUDA tensors) beside the plain-torch reference
(used on the CPU, and as the thing every kernel is checked against).
"""

import os as _os

if __name__ == "kernels":
    # Python started in a muon-offload checkout's root finds this folder as a top-level
    # ``kernels`` ahead of PyPI's package of that name, which transformers imports (its hub
    # kernels, a dependency since 5.25): say so here rather than fail inside the caller.
    raise ImportError(
        "this 'kernels' is muon-offload's kernels/ folder, importable as a top-level module "
        "because Python runs from the muon-offload checkout's root; it is "
        "'muon_offload.kernels'. Run from another folder (or with python -P) so that "
        "'import kernels' finds PyPI's package."
    )

if _os.environ.get("TRITON_INTERPRET", "0") == "1":
    # Before any kernel module defines a kernel: see _interpreter.py for what it fixes.
    from ._interpreter import squeeze_interpreter_scalars as _squeeze

    _squeeze()
