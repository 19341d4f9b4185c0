"""A process that compiles Triton kernels into Triton's disk cache, for ``precompile.py``.

It reads pickled jobs from stdin, one at a time, compiles each with ``triton.compile`` (which
writes the binary into the cache that the launching process then reads) and writes one
pickled reply per job to stdout: None, or the error's text. A fresh interpreter (not a fork
of a process that holds a CUDA context), started as ``python -m``, so a training script is
never re-imported in it.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import sys


def compile_job(job: tuple) -> None:
    """job: (module, kernel name, signature, constants, attrs, target, options)."""
    module, name, signature, constants, attrs, target, options = job
    import triton
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), name)
    triton.compile(ASTSource(fn, signature, constants, attrs), target=target, options=options)


def warm() -> None:
    """Import Triton's compiler and the kernel modules before the first job comes (about a
    compile's time, torch's import the most of it): a pool started early has done it by then.
    A module that fails to import fails its jobs, with the error, instead."""
    import pkgutil

    import triton.compiler  # noqa: F401

    kernels = importlib.import_module("muon_offload.kernels")
    for info in pkgutil.iter_modules(kernels.__path__):
        try:
            importlib.import_module(f"{kernels.__name__}.{info.name}")
        except Exception:  # noqa: BLE001, S112 (its jobs raise it)
            continue


def main() -> None:
    jobs, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # whatever a compile prints must not mix with the replies
    with contextlib.suppress(Exception):  # each job imports what it needs, and raises
        warm()
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:
            return
        try:
            compile_job(job)
            reply = None
        except Exception as err:  # the launch compiles it again and raises it there
            reply = f"{type(err).__name__}: {err}"[:2000]
        pickle.dump(reply, replies)
        replies.flush()


if __name__ == "__main__":
    main()
