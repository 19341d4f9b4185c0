"""The optimizer's small surface for tools (the bench, profilers): what it holds where, and
how a step's chunks ran. Nothing here is needed to train."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .timeline import stage_rows

if TYPE_CHECKING:
    from .settings import LiveSettings
    from .state import StateStore
    from .streams import Streams


class Tools:
    """What tools read of an optimizer (its host slabs, the scheduler's arena, a timeline of
    its chunks) and ``reconfigure``; the optimizer's public methods of those names are these.
    """

    def __init__(self, store: StateStore, streams: Streams, settings: LiveSettings, plans):
        self._store, self._streams, self._settings, self._plans = store, streams, settings, plans

    @property
    def host_state_bytes(self) -> int:
        """Bytes of host memory (pinned where a GPU exists) held for streamed state."""
        return self._store.host.nbytes if self._store.host is not None else 0

    def host_buffers(self) -> list[Tensor]:
        """The host buffers (uint8) that hold streamed state, for reading it all at once (after
        the last step's write-backs landed)."""
        self._streams.synchronize()
        return list(self._store.host.slabs) if self._store.host is not None else []

    @property
    def staging_bytes(self) -> int:
        """Bytes of the device staging arena (0 before the first offloaded step)."""
        sched = self._streams.scheduler
        return sched.staging_bytes if sched is not None else 0

    @contextlib.contextmanager
    def timeline(self) -> Iterator[list[dict]]:
        """Record the chunk stages of the steps run inside the block::

            with opt.timeline() as rows:
                opt.step()

        ``rows`` is filled on exit: ``{"chunk", "stage", "start_ms", "end_ms"}`` per chunk and
        stage (``load``, ``update``, ``store``), ms from the first start: CUDA events on each
        stream on a GPU; on the CPU the stages run one after another."""
        rows: list[dict] = []
        marks: list = []
        self._streams.marks = marks  # a step hands them to its scheduler (``Streams.for_step``)
        try:
            yield rows
        finally:
            self._streams.marks = None
            sched = self._streams.scheduler
            if sched is not None:
                sched.timeline = None
                if sched.cuda:
                    torch.cuda.synchronize(sched.device)
                rows.extend(stage_rows(marks, sched.cuda))

    def reconfigure(
        self, chunk_bytes: int | None = None, resident_chunk_bytes: int | None = None
    ) -> None:
        """Other chunk budgets for the same state: the next step plans afresh and sizes a new
        staging arena. State stays where it is; a budget left None keeps its value. Both are
        checked (``Settings.replace``) before either changes."""
        budgets = dict(chunk_bytes=chunk_bytes, resident_chunk_bytes=resident_chunk_bytes)
        settings = self._settings.changed(**{k: v for k, v in budgets.items() if v is not None})
        self._streams.synchronize()
        self._settings.now = settings
        self._streams.drop()
        self._plans.clear()
