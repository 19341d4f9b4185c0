"""The second block of ``precompile.compile_then_tune``, beside the timing of the keys.

The pass's first block leaves each key the tuner must time to after it, compiling only its
candidates' timing launches; the keys are then timed one after another on the card (seconds),
and each unit that left keys is run again in a second block, where its launches find them
decided and compile each winner's own launch (seconds). ``Winners`` runs that second block on
a thread while the keys are timed: a unit runs as soon as the last key it left is timed, so
its winners compile (on the worker processes) while the next keys are timed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import torch


class Winners:
    """A thread that runs ``units`` (callables) inside ``block()`` (a ``compiling_ahead``
    block), in order, each once the last key it left is timed (``timed(n)``: the ``n``-th key
    left, of unit ``owners[n]``, is decided): its launches then find their keys decided, so
    none is timed twice, nor compiles every candidate. A unit that left no key is not run
    (its launches compiled in the first block). On ``stream`` (the timing thread's, None off
    CUDA): the tables its launchers copy are ordered with the timing's launches. Leaving waits
    for the thread and raises its error; after an error in the timing, the units not yet run
    are left to the step."""

    def __init__(
        self,
        units: Sequence[Callable[[], None]],
        owners: Sequence[int],
        block: Callable[[], contextlib.AbstractContextManager],
        stream=None,
    ) -> None:
        self._units, self._owners, self._block, self._stream = units, owners, block, stream
        self._last = {u: n for n, u in enumerate(owners)}  # a unit -> the last key it left
        self._ready = {u: threading.Event() for u in sorted(self._last)}
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="muon-offload-winners", daemon=True)

    def __enter__(self) -> Winners:
        self._thread.start()
        return self

    def timed(self, n: int) -> None:
        unit = self._owners[n]
        if self._last[unit] == n:
            self._ready[unit].set()

    def __exit__(self, exc_type, *exc) -> None:
        self._stop = exc_type is not None  # before the events: the thread reads it after
        for ready in self._ready.values():
            ready.set()
        self._thread.join()
        if self._error is not None and exc_type is None:
            raise self._error

    def _run(self) -> None:
        try:
            with contextlib.ExitStack() as here:
                if self._stream is not None:
                    here.enter_context(torch.cuda.device(self._stream.device))
                    here.enter_context(torch.cuda.stream(self._stream))
                here.enter_context(self._block())
                for unit, ready in self._ready.items():
                    ready.wait()
                    if self._stop:
                        return
                    self._units[unit]()
        except BaseException as err:  # noqa: BLE001 (raised again on the timing's thread)
            self._error = err


def this_stream(device: torch.device):
    """This thread's current stream on ``device`` (None off CUDA or without one)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.current_stream(device)
