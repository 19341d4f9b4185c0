"""Fused kernels and the torch references they are tested against.

Installed as ``muon_offload.kernels``. Each module holds one kernel family: its Triton
kernels and typed launchers (used for CUDA tensors) beside the plain-torch reference
(used on the CPU, and as the thing every kernel is checked against).
"""

import os as _os

if __name__ == "kernels":
    # Python started in a muon-offload checkout's root finds this folder as a top-level
    # ``kernels`` ahead of PyPI's package of that name, which transformers imports (its hub
    # kernels, a dependency since 5.25) and whose setuptools plugin a build from the root
    # loads: hand over to that package where one is installed (the import returns what
    # ``sys.modules`` holds when this module's code ends), else say so here rather than fail
    # inside the caller.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        raise ImportError(
            "this 'kernels' is muon-offload's kernels/ folder, importable as a top-level "
            "module because Python runs from the muon-offload checkout's root; it is "
            "'muon_offload.kernels'. Run from another folder (or with python -P) so that "
            "'import kernels' finds PyPI's package."
        )
    _sys.modules["kernels"] = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_sys.modules["kernels"])
elif _os.environ.get("TRITON_INTERPRET", "0") == "1":
    # Before any kernel module defines a kernel: see _interpreter.py for what it fixes.
    from ._interpreter import squeeze_interpreter_scalars as _squeeze

    _squeeze()
