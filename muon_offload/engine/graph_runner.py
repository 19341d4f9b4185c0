"""The optimizer's side of ``cuda_graph``: whether a step goes through ``StepGraphs``
(``graphs.py``: captured, replayed, or eager while its key settles), and running its GPU work
so. ``blocker``: why "auto" stays eager for the whole optimizer (a mesh, a DTensor group).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from . import capture_rules, graphs
from .graphs import StepGraphs

if TYPE_CHECKING:
    from .settings import LiveSettings
    from .streams import Streams


class GraphRunner:
    """Runs each step's chunks through the scheduler: eagerly, or through the ``StepGraphs``
    it keeps (made for the step's device on the first step that may use them)."""

    def __init__(
        self, settings: LiveSettings, streams: Streams, algorithms: dict, blocker: str | None
    ) -> None:
        self._settings, self._streams, self._algorithms = settings, streams, algorithms
        self.graphs: StepGraphs | None = None
        self.ungraphed_steps = 0  # steps run eagerly outside ``graphs`` (``stats``)
        self.blocker = blocker  # why "auto" keeps every step eager, None if nothing

    def run(self, work, layouts, hypers, transfers, update, side, closure, state, tables) -> None:
        """The step's GPU work, the chunks through the scheduler (``side``: the chunks it may
        run on its side lane): run eagerly, or captured and replayed (``cuda_graph``; eager
        while ``timeline()`` records, and with ``"auto"`` where a graph cannot run).
        ``tables``: the step's scalar and gradient tables (None where it has none). Its stores
        are left running only while no graph is in use: a replay's loads, captured, would not
        wait for them (``prefetch.py``)."""
        sched = self._streams.scheduler
        sched.ahead.leave = not self.in_use(sched.device)

        def body() -> None:
            sched.run(transfers, update, side)

        if not self.graphed(sched.device, closure):
            self.ungraphed_steps += 1  # eager steps all the same (``stats``)
            body()
            return
        if self.graphs is None or self.graphs.device != sched.device:
            # Nobody asked for graphs with "auto": giving them up is no warning's worth.
            level = logging.INFO if self._settings.now.cuda_graph == "auto" else logging.WARNING
            self.graphs = StepGraphs(sched.device, give_up_level=level)
        if self.graphs.off is not None:  # given up: no key to compute
            self.graphs.step(None, self.graphs.off, layouts, body)
            return
        streamed = sched.prepare(transfers, side)  # the arena as this step uses it, for the key
        scalars, grads = tables
        if scalars is None:
            key, why = None, "the step runs no Triton kernels"
        else:
            key, why = graphs.step_key(  # the module's: tests wrap it there
                work,
                layouts,
                hypers,
                state,
                self._algorithms,
                sched.staging_buffers,
                scalars.buffer,
                self._settings.now.backend,
                grads and grads.key(),
            )
        # A head graph and a held tail (graph_ends.py) where something runs beside the ends:
        # its first loads were asked for ahead (prefetch(), the backward hook).
        split = streamed and sched.ahead.asked
        ends = (sched, transfers, side) if split else None
        self.graphs.step(key, why, layouts, body, ends)

    def graphed(self, device: torch.device, closure: bool) -> bool:
        """Whether this step goes through ``StepGraphs`` (captured, replayed, or eager while
        its key settles)."""
        cuda_graph = self._settings.now.cuda_graph
        if cuda_graph is False or self._streams.marks is not None:
            return False
        if cuda_graph is True:
            return True  # refused before anything ran where it cannot capture
        blocker = self.blocker or capture_rules.auto_blocker(
            device, self._settings.now.backend, self._algorithms.values()
        )
        return blocker is None and not closure

    def in_use(self, device) -> bool:
        """Whether a step may go through ``StepGraphs`` (captured, replayed, eager meanwhile):
        not once graphs are given up (``off``), whatever ``cuda_graph`` says (with ``True``
        too, the steps stay eager from then on)."""
        if self.graphs is not None:
            return self.graphs.off is None
        return self.graphed(device, False)

    def stats(self) -> dict | None:
        """With ``cuda_graph`` True or "auto": captures, replays, eager steps, whether a graph
        is held, its memory pool's bytes (approximate: the reserved memory the capture added),
        why graphs were given up (None while they are not), and, for the held graph of a step
        that streams state, how often its first loads ran ahead of the step (``prefetch()``,
        the backward hook) and how often the step loaded them itself. None with False."""
        if self._settings.now.cuda_graph is False:
            return None
        stats = (self.graphs or StepGraphs(torch.device("cpu"))).stats()
        stats["eager_steps"] += self.ungraphed_steps  # off CUDA, with a closure, timed
        return stats
