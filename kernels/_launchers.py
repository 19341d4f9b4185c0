"""The C launchers of kernels the compile pass compiled, made before their first launch.

Triton 3.6 launches each kernel signature through a small C extension of its own: the
driver's launcher class writes its source, gcc builds it (about a quarter of a second) and
Triton's cache dir keeps it by the source's hash. It is made when a variant first launches
(``CompiledKernel._init_handles``), on the launching thread: a fresh first step waited 3 s in
the step on a dozen of them, one after another, after the pass had compiled every binary.
``build(kernel)`` makes a just-compiled kernel's launcher on the pass's load threads (gcc
runs as a process, so the threads overlap); the launch then finds its extension in the cache.
Triton 3.9 launches every kernel through one generic launcher: making one costs nothing there.
"""

from __future__ import annotations

import logging
import threading

_LOG = logging.getLogger("muon_offload")
_LOCK = threading.Lock()
# Kernels of one signature share a launcher source: the second waits for the first's build,
# then finds it in the cache, instead of running gcc on the same source beside it.
_BUILDING: dict[str, threading.Lock] = {}
_WARNED = [False]  # a failed build is said once a process


def launcher_class():
    """The class a compiled kernel makes its launcher with (the active driver's), or None for
    a Triton without one."""
    try:
        from triton.runtime.driver import driver

        return driver.active.launcher_cls
    except (ImportError, AttributeError):
        return None


def build(kernel) -> bool:
    """Make the launcher of ``kernel`` (a compiled kernel: its ``src`` and ``metadata``, as its
    first launch makes it), which leaves the launcher's C extension in Triton's cache; whether
    one was made. Anything else is left alone. A failure is a warning, once a process, and
    changes nothing: the kernel's launch makes it again, and raises there."""
    src, metadata = getattr(kernel, "src", None), getattr(kernel, "metadata", None)
    if src is None or metadata is None:
        return False
    cls = launcher_class()
    if cls is None:
        return False
    key = repr((getattr(src, "signature", None), getattr(metadata, "tensordesc_meta", None)))
    with _LOCK:
        same = _BUILDING.setdefault(key, threading.Lock())
    try:
        with same:
            cls(src, metadata)
    except Exception as err:  # noqa: BLE001 (the launch makes it, as without this)
        if not _WARNED[0]:
            _WARNED[0] = True
            _LOG.warning(
                "muon-offload: making a kernel's launcher ahead failed (%s: %s); launchers are "
                "made at their kernels' first launch",
                *(type(err).__name__, err),
            )
        return False
    return True
