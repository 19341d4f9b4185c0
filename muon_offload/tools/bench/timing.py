"""Timing for the benches: a clock that waits for the device, timed steps, pinned-copy
bandwidths and the transfer floor they set. Shared by ``muon-offload bench`` and ``bench/``."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch

GIB = 1 << 30
MIB = 1 << 20


class Clock:
    """Host timing that waits for the device before each reading, and the device's memory,
    when there is a GPU; on the CPU memory readings are None."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def peak_added_gib(self, base: int) -> float | None:
        peak = self.peak()
        return (peak - base) / GIB if peak is not None else None

    def free(self) -> None:
        """Between modes, before the next one's memory readings: cyclic garbage collected and
        the allocator's cache emptied. On the CPU nothing is read (``peak`` is None) and a
        mode's objects go with their last reference: a collection there found nothing to
        free (the tiny bench's 22) and cost up to 0.7 s each in a process holding torch."""
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()


def step_times(
    step: Callable[[], object],
    clock: Clock,
    warmup: int,
    steps: int,
    *,
    before_each: Callable[[], None] | None = None,
) -> list[float]:
    """Seconds of each of ``steps`` calls after ``warmup`` untimed ones; the peak memory is
    reset after the warm-up. ``before_each`` (default: wait for the device) also runs once
    after the warm-up; several ranks pass a barrier, so a step starts on all at once."""
    before_each = before_each or clock.sync
    for _ in range(warmup):
        step()
    before_each()
    clock.reset_peak()
    times = []
    for _ in range(steps):
        before_each()
        start = time.perf_counter()
        step()
        clock.sync()
        times.append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> dict:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "steps": len(times),
    }


def time_steps(
    step: Callable[[], object], clock: Clock, warmup: int, steps: int, base: int
) -> dict:
    """Median, min and max step time, and the peak memory added above ``base`` bytes."""
    times = step_times(step, clock, warmup, steps)
    return {**summary(times), "peak_added_gib": clock.peak_added_gib(base)}


def rotated(names: list[str], round_: int) -> list[str]:
    """The order of one round of interleaved steps: rotated each round, so that drifts of the
    card (clocks, temperature) and of the host fall on every optimizer alike."""
    k = round_ % len(names)
    return names[k:] + names[:k]


def bandwidths(
    nbytes: int = GIB,
    reps: int = 5,
    *,
    before_each: Callable[[], None] = torch.cuda.synchronize,
    device_copy: bool = True,
) -> dict:
    """GB/s (1e9 bytes/s): h2d alone, d2h alone, each direction when both run at once, and
    (``device_copy``) the device copy (bytes read + written). ``before_each`` starts every
    repetition; several ranks pass a barrier, so they all copy in the same phase."""
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn):
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            before_each()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    def both():
        with torch.cuda.stream(s1):
            dev_b.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_a, non_blocking=True)

    out = {
        "h2d_alone": nbytes / timed(lambda: dev_b.copy_(host_a, non_blocking=True)) / 1e9,
        "d2h_alone": nbytes / timed(lambda: host_b.copy_(dev_a, non_blocking=True)) / 1e9,
        "both_each": nbytes / timed(both) / 1e9,
    }
    if device_copy:
        out["device_copy"] = 2 * nbytes / timed(lambda: dev_b.copy_(dev_a)) / 1e9
    return out


# fp32 state, and bf16 state at half its bytes.
STATE_DTYPES = (("fp32", 1.0), ("bf16", 0.5))


def floor_s(state_bytes: float, bandwidth: dict | None) -> float | None:
    """The transfer floor of an offloaded step: each direction moves the state once, both at
    once, so state bytes over the both-directions bandwidth; None when not measured."""
    return state_bytes / (bandwidth["both_each"] * 1e9) if bandwidth else None
