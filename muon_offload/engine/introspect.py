"""The optimizer's small surface for tools (the bench, profilers): what it holds where, and
how a step's chunks ran. Nothing here is needed to train."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from .timeline import stage_rows


class ToolsSurface:
    """Mixed into ``ChunkedOptimizer``; reads its store and scheduler."""

    @property
    def host_state_bytes(self) -> int:
        """Bytes of host memory (pinned where a GPU exists) held for streamed state."""
        return self._store.host.nbytes if self._store.host is not None else 0

    def host_buffers(self) -> list[Tensor]:
        """The host buffers (uint8) that hold streamed state, for reading it all at once (after
        the last step's write-backs landed)."""
        self._synchronize()
        return list(self._store.host.slabs) if self._store.host is not None else []

    @property
    def staging_bytes(self) -> int:
        """Bytes of the device staging arena (0 before the first offloaded step)."""
        return self._scheduler.staging_bytes if self._scheduler is not None else 0

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
        self._timeline_marks = marks  # step() hands it to the scheduler
        try:
            yield rows
        finally:
            self._timeline_marks = None
            sched = self._scheduler
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
        settings = self._changed_settings(**{k: v for k, v in budgets.items() if v is not None})
        self._synchronize()
        self._settings = settings
        self._scheduler = None
        self._plans.clear()

    @property
    def _host(self):  # the host slabs, for tests that check where state lives
        return self._store.host

    @property
    def _streamed(self) -> set[Tensor]:
        return self._store.streamed
