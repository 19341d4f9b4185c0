"""Fused kernels and the torch references they are tested against.

Installed as ``muon_offload.kernels``. Each module holds one kernel family: its Triton
kernels and typed launchers (used for CUDA tensors) beside the plain-torch reference
(used on the CPU, and as the thing every kernel is checked against).
"""

import os as _os

if _os.environ.get("TRITON_INTERPRET", "0") == "1":
    # Before any kernel module defines a kernel: see _interpreter.py for what it fixes.
    from ._interpreter import squeeze_interpreter_scalars as _squeeze

    _squeeze()
