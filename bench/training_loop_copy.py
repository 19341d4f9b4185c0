"""bench/training_loop.py's iterations: one mode's model and optimizer copy, an iteration of
the loop users write (synchronized one by one, or back to back), and what each measures: the
iteration's seconds, the step's GPU and host milliseconds, the device milliseconds of the
phases before the step."""

from __future__ import annotations

import itertools
import time

import torch
from transformers_step import Meter, cosine


class Copy:
    """One mode's model and optimizer, and what its iterations measured."""

    def __init__(self, model, opt, total: int, sync_before_step: bool = False):
        self.model, self.opt, self.total = model, opt, total
        self.sync_before_step = sync_before_step  # the host ms: issuing the step alone
        self.base_lrs = [g["lr"] for g in opt.param_groups] if opt is not None else []
        self.done = 0  # iterations run, warm-up included: the next batch's index
        self.first_step: dict | None = None
        self.iter_s: list[float] = []
        self.step_ms: list[float] = []
        self.host_ms: list[float] = []
        self.losses: list[float] = []
        self.phase_ms: dict[str, list[float]] = {}  # synced CUDA iterations: GPU ms a phase
        self.run_s: list[float] = []  # back-to-back blocks: seconds an iteration
        # Back-to-back CUDA iterations: device ms a phase (the forward under what the last
        # step left running: its stores, the host's queue).
        self.b2b_phase_ms: dict[str, list[float]] = {}
        self.pending: list[tuple] = []  # back-to-back iterations' losses, stopwatches, marks
        self.held = self.added = self.peak = self.reserved = None

    def iteration(
        self, batch: torch.Tensor, meter: Meter, timed: bool, synced: bool = True
    ) -> torch.Tensor:
        """One iteration; ``synced``: the device synchronized before the forward and after
        ``zero_grad()``, the iteration's seconds recorded. Returns the loss (not read)."""
        model, opt = self.model, self.opt
        groups = opt.param_groups if opt is not None else []
        for group, lr in zip(groups, self.base_lrs, strict=True):
            group["lr"] = lr * cosine(self.done, self.total)
        if synced:
            meter.sync()
        marks = Marks(meter.cuda and timed)
        start = time.perf_counter()
        with torch.autocast(batch.device.type, dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        marks.mark()
        loss.backward()
        marks.mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        marks.mark()
        step = None
        if opt is None:
            model.zero_grad()
        else:
            step = Stopwatch(meter.cuda)
            if self.sync_before_step:
                meter.sync()
            with step:
                opt.step()
            opt.zero_grad()
        self.done += 1
        if not synced:  # read after the caller's sync
            self.pending.append((loss.detach(), step if timed else None, marks))
            return loss
        meter.sync()
        seconds = time.perf_counter() - start
        if step is not None and self.first_step is None:
            self.first_step = {"s": step.ms() / 1e3, "host_s": step.host_ms / 1e3}
        self.record(loss, step if timed else None)
        if timed:
            self.iter_s.append(seconds)
            if marks.events:
                phases = marks.ms()
                for phase, ms in zip(PHASES, phases, strict=True):
                    self.phase_ms.setdefault(phase, []).append(ms)
                # What the iteration took after the clip: the step, zero_grad() and the
                # copies the step left running, up to the sync (the device's start is the
                # host's: the first event follows a sync).
                self.phase_ms.setdefault(AFTER_CLIP, []).append(seconds * 1e3 - sum(phases))
        return loss

    def record(self, loss: torch.Tensor, step: Stopwatch | None) -> None:
        self.losses.append(loss.item())
        if step is not None:
            self.step_ms.append(step.ms())
            self.host_ms.append(step.host_ms)

    def back_to_back(self, tokens: torch.Tensor, iters: int, meter: Meter) -> None:
        """``iters`` iterations issued one after the other, the device synchronized only before
        the first and after the last, as a training loop that reads no figure per iteration
        runs: what one iteration's step leaves running (stores, the host's queue) overlaps the
        next. Records the block's seconds an iteration."""
        meter.sync()
        start = time.perf_counter()
        for _ in range(iters):
            self.iteration(tokens[self.done], meter, timed=True, synced=False)
        meter.sync()
        self.run_s.append((time.perf_counter() - start) / iters)
        for loss, step, marks in self.pending:
            self.record(loss, step)
            if marks.events:  # from the compute stream's start of the iteration: after the
                for phase, ms in zip(PHASES, marks.ms(), strict=True):  # last one's work
                    self.b2b_phase_ms.setdefault(phase, []).append(ms)
        self.pending.clear()


PHASES = ("forward", "backward", "clip")
AFTER_CLIP = "after clip"


class Marks:
    """CUDA events on the current stream from an iteration's start to each phase's end (none
    off CUDA or when not asked): the device's milliseconds a phase, queued work and idle
    gaps between kernels included, so a mode whose hooks or side streams slow backward
    shows it against ``no_step``."""

    def __init__(self, on: bool):
        self.events = [torch.cuda.Event(enable_timing=True)] if on else []
        if on:
            self.events[0].record()

    def mark(self) -> None:
        if self.events:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()

    def ms(self) -> list[float]:
        return [a.elapsed_time(b) for a, b in itertools.pairwise(self.events)]


class Stopwatch:
    """A ``step()``'s GPU milliseconds (CUDA events on the current stream; on the CPU the
    host's) and its host milliseconds, without synchronizing: read ``ms()`` after a sync."""

    def __init__(self, cuda: bool):
        self.events = [torch.cuda.Event(enable_timing=True) for _ in "ab"] if cuda else None

    def __enter__(self):
        if self.events:
            self.events[0].record()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.host_ms = (time.perf_counter() - self.start) * 1e3
        if self.events:
            self.events[1].record()

    def ms(self) -> float:
        return self.events[0].elapsed_time(self.events[1]) if self.events else self.host_ms


def block(
    copy: Copy, tokens: torch.Tensor, iters: int, meter: Meter, back_to_back: bool = False
) -> None:
    """``iters`` timed iterations of one mode (and as many back to back), with its memory
    peaks over them."""
    meter.sync()
    meter.reset_peak()
    base = meter.allocated()
    for _ in range(iters):
        copy.iteration(tokens[copy.done], meter, timed=True)
    if back_to_back:
        copy.back_to_back(tokens, iters, meter)
    if meter.cuda:
        peak = meter.peak()
        copy.added = max(copy.added or 0, peak - base)
        copy.peak = max(copy.peak or 0, peak)
        copy.reserved = max(copy.reserved or 0, torch.cuda.max_memory_reserved())
