"""Each streamed chunk's tensor views and copy runs in the staging arena, and what the
algorithms derive from those views, kept as long as the plan and the arena stay the same
(slicing costs microseconds a call, chunks a step): the scheduler's cache."""

from __future__ import annotations

from torch import Tensor


class StagedViews:
    """By chunk index: its views and (host bytes, arena bytes) runs, and its memo."""

    def __init__(self) -> None:
        self._staged: dict[int, tuple[tuple[Tensor, ...], tuple]] = {}
        self._memos: dict[int, dict] = {}
        self._loads: dict[int, tuple] = {}

    def clear(self) -> None:
        """A new plan or arena: the views go, and with them all that was derived from them,
        so that nothing kept holds an arena that a new one replaced."""
        self._staged.clear()
        self._memos.clear()
        self._loads.clear()

    def memo(self, chunk: int) -> dict:
        return self._memos.setdefault(chunk, {})

    def of(self, chunk: int, transfer, arena: Tensor, base: int) -> tuple:
        """The views and runs of ``chunk``, whose ``transfer`` lies in ``arena`` from ``base``."""
        staged = self._staged.get(chunk)
        if staged is None:
            buf = arena[base : base + transfer.nbytes]
            views = tuple(
                buf[off : off + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for off, shape, dtype in transfer.views
            )
            runs = tuple(
                (run.host, buf[run.offset : run.offset + run.host.numel()]) for run in transfer.runs
            )
            staged = self._staged[chunk] = (views, runs)
        return staged

    def loads(self, chunk: int, transfer, runs, spans) -> tuple:
        """The chunk's load cut at ``spans`` ((holder, first byte, end) of the chunk's bytes,
        ``ArenaLayout.spans``): per span holding bytes of its ``runs`` (``of``), the holder and
        the (host bytes, arena bytes) pieces of those runs in it."""
        loads = self._loads.get(chunk)
        if loads is None:
            cut = []
            for holder, lo, hi in spans:
                pieces = []
                for run, (host, staged) in zip(transfer.runs, runs, strict=True):
                    a = max(lo - run.offset, 0)  # the span's bytes in the run's
                    b = min(hi - run.offset, host.numel())
                    if a < b:
                        pieces.append((host[a:b], staged[a:b]))
                if pieces:
                    cut.append((holder, tuple(pieces)))
            loads = self._loads[chunk] = tuple(cut)
        return loads
