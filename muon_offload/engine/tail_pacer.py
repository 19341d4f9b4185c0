"""A held tail's stores (``prefetch.HeldTail``) queued from a thread of their own, a few small
slices at a time, while backward runs.

The copy engine that writes to the host runs its queued copies in the order they came, from
every stream: a small copy that backward waits for on the host (an MoE's routing: torch's
``_grouped_mm`` reads its group offsets so, once a layer) waits for every store queued before
it. Gradient hooks cannot keep that queue short and busy at once: they come in bursts, when
the host runs ahead of the GPU, and none while it waits. On the H200, the Qwen3-MoE loop's
backward with a 3 GiB tail paced by its hooks (a 96 MiB slice from each hook that found the
last one run) held 11 routing reads an iteration behind a slice, 1.24 ms each instead of
0.27 (docs/benchmarks.md, "A thread for the tail"; 0.43 ms with the thread). The thread
queues a slice whenever one of the ``PACE_DEPTH`` before it has run: the engine never idles
while stores are left, and a routing read waits for two 16 MiB slices at most (0.6 ms at
55 GB/s). It waits on events (the GIL released) and holds the GIL only to queue a copy. It
runs while nothing else queues stores: whatever needs the tail's bytes or the d2h stream
(``prefetch.launch_tail``: the next loads, a capture, a host reader) stops it first. Without
CUDA (the CPU path, which CI runs) the same thread copies the slices itself, one after
another, while backward computes. A tail of at most ``PACE_DEPTH`` slices needs no thread: the
hook queues it (``prefetch.pace_tail``).
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import nullcontext

import torch

PACE_SLICE_BYTES = 16 << 20
PACE_DEPTH = 2


class TailPacer:
    """Queues ``tail``'s stores on ``sched``'s d2h stream from a thread, started at once;
    ``done`` once every store is queued. ``stop()`` ends the thread where it is (what is left
    stays in ``tail``) and returns what the thread raised, if anything."""

    def __init__(self, sched, tail) -> None:
        self.sched, self.tail = sched, tail
        self.done = False
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="muon-offload-stores", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sched, tail = self.sched, self.tail
        on_device = sched.device.type == "cuda"
        try:
            with torch.cuda.device(sched.device) if on_device else nullcontext():
                queued: deque = deque()
                while not self._stopping.is_set():
                    if len(queued) == PACE_DEPTH:
                        queued.popleft().synchronize()  # the GIL released while it waits
                        continue
                    if tail.issue(sched, PACE_SLICE_BYTES):
                        self.done = True
                        return
                    if sched.cuda:  # without CUDA each slice is copied when queued
                        event = torch.cuda.Event()
                        event.record(sched.d2h_stream)
                        queued.append(event)
        except BaseException as err:  # raised on the caller's thread (launch_tail)
            self._error = err

    def stop(self) -> BaseException | None:
        self._stopping.set()
        self._thread.join()
        return self._error
