"""The optimizer's stream scheduler (``scheduler.py``): made for the device a step runs on,
dropped when the chunk budgets change (they size its staging arena), and the host's wait for
what a step left running or held on its streams (``prefetch.py``: the stores it leaves).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .prefetch import finish, settle_tail
from .scheduler import StreamScheduler

if TYPE_CHECKING:
    from .settings import LiveSettings
    from .state import StateStore


class Streams:
    """Holds the scheduler the steps run through, and what ``timeline()`` records into."""

    def __init__(self, store: StateStore, settings: LiveSettings) -> None:
        self._store = store  # whose state is streamed: only then is there anything to wait for
        self._settings = settings
        self.scheduler: StreamScheduler | None = None
        self._sizing = self._sizing_of(settings.now)  # what sized the scheduler's arena
        self.marks: list | None = None  # the chunk stages to record (``Tools.timeline``)

    def for_step(self, device: torch.device) -> StreamScheduler:
        """The scheduler of a step on ``device``: a new one if the device changed, or what
        sizes the staging beyond its ring (``prefetch_bytes``, ``state_dtype``: see
        ``Settings.staging_for``); an arena only grows, so a smaller one is a new one."""
        sizing = self._sizing_of(self._settings.now)
        sched = self.scheduler
        if sched is None or sched.device != device or sizing != self._sizing:
            self.synchronize()  # the old arena's loads and stores finished first
            settings = self._settings
            self.scheduler = StreamScheduler(
                device, staging=lambda streamed: settings.now.staging_for(streamed)
            )
            if sched is not None:
                # Whether the loop asks for loads ahead is the loop's, not the arena's: a step
                # captured before the new scheduler's first hook is split as the old one's.
                self.scheduler.ahead.asked = sched.ahead.asked
            self._sizing = sizing
        self.scheduler.timeline = self.marks
        return self.scheduler

    @staticmethod
    def _sizing_of(settings) -> tuple:
        return settings.prefetch_bytes, settings.state_dtype

    def synchronize(self) -> None:
        """Wait for in-flight write-backs (and loads), so host state can be read by the CPU:
        a step leaves its stores running (``prefetch.leave_stores``)."""
        sched = self.scheduler
        if self._store.streamed and sched is not None:
            finish(sched)

    def settle_tail(self) -> None:
        """Launch the stores a replayed step held back (``prefetch.hold_tail``) and wait for
        them on the host: ``opt.state`` is read."""
        if self.scheduler is not None:
            settle_tail(self.scheduler)

    def drop(self) -> None:
        """Forget the scheduler (new budgets): the next step sizes a new staging arena."""
        self.scheduler = None


class SettledState:
    """``Optimizer.state`` of a ``ChunkedOptimizer``: the dict torch's ``Optimizer`` keeps,
    read after the stores a replayed step held back (``prefetch.hold_tail``: queued from the
    next backward otherwise) are queued and waited for, so that offloaded state read, copied
    or written in place from here is the step's, as after an eager step and a
    ``torch.cuda.synchronize()``."""

    def __get__(self, opt, owner=None):
        if opt is None:
            return self
        streams = opt.__dict__.get("_streams")
        if streams is not None:
            streams.settle_tail()
        return opt.__dict__["state"]

    def __set__(self, opt, value) -> None:
        opt.__dict__["state"] = value

    @staticmethod
    def held(opt) -> dict:
        """The dict, as it is (the step's own reads)."""
        return opt.__dict__["state"]
