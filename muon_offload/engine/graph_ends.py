"""A captured step that streams state, as three CUDA graphs: its first loads run under backward
and its last stores under the next forward, as an eager step's do (prefetch.py).

A replay runs its graph as a whole on the stream it is launched on, and a capture must join
every stream it forks, so one graph of the step would hold its first loads until the replay
starts (after backward) and the compute stream until its last stores end. The step is captured
instead as

- the *head*: the loads ``prefetch.issue`` would queue (the first streamed chunks that fit in
  the arena before it wraps, ``first_loads``);
- the *main* graph: the run with those loads taken (as an eager run takes prefetched loads;
  their updates wait for no load event: none recorded in the capture), and the stores of the
  *tail* left out;
- the *tail*: the stores of the chunks whose staging bytes no later load of the run takes
  (``tail_of``: in no load's waits; the last ring's slots), which the main graph so need not
  finish. Each waits for its chunk's update through an external event (CUDA's event record
  and wait nodes): the main graph records it at the update's end, the tail's wait node names
  it, so a store need not wait for the main graph's end (a synchronized loop waited 4 ms
  after an offloaded 8-bit step's main graph when the tail waited for all of it). The first
  waits, likewise, for the main graph's last store of each store stream
  (``prefetch.stores_end``): beside them, the tail's stores took the copy engine from the
  stores that the step's own loads wait for.

Each is captured as the main graph alone was (graphs.py), in one step, under one key: a key
change drops all three, a capture miss in any gives graphs up. Their replays are ordered by
plain events recorded and waited on outside any capture:

    h2d stream       [waits: last tail's end] head  (from prefetch(): under backward)
    compute stream   ... backward ... [waits: head's end] main | forward ...
    d2h stream                          tail [each store waits: its update in main] | ...

- The head's loads write arena bytes and read host state: the last step's tail ends first
  (and through it every update and store of a streamed chunk of that step: the tail's last
  store follows the last streamed chunk's update, after its load, which the loads before it
  and the stores they waited for precede); backward's work is not
  waited for, except when the step replays the head itself (no ``prefetch()`` before it), or
  the last step joined its stores (eager, or a capture): then the h2d stream waits for
  whatever the compute stream queued before, as ``prefetch.issue`` does.
- The main graph follows the head (its updates read the head's bytes; its own loads take
  bytes whose last holders it waits for inside the graph, after the head's chunks).
- The tail's stores follow their chunks' updates and the main graph's stores (launched
  after the main graph, its wait nodes name that replay's records); the compute stream does
  not wait for it. Its end is
  what the next head, an eager step's loads (``prefetch.take``), and every host reader
  (``finish``: the d2h stream) wait for, as ``ahead.stores``.

Only a step whose first loads were asked for ahead (``prefetch()``, the backward hook: the
scheduler's ``ahead.asked``) is split (graph_runner.py): without anything beside its ends, one
graph of the step overlaps them with its own updates, which the split cannot (the main graph
waits for all of the head's loads; the tail starts after the main graph's end).

Nothing more is staged: the head and tail read and write the arena's bytes of the main graph.
Without CUDA the three replay in order (the CPU tests' stand-in graphs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import prefetch


def tail_of(layout) -> frozenset[int]:
    """The streamed chunks (by place) whose stores no load of the run waits for."""
    taken = set().union(*layout.waits)
    return frozenset(k for k in range(len(layout.offsets)) if k not in taken)


def _copy(sched, chunks: list[int], load: bool, after: list | None = None, first=()) -> None:
    """Copy ``chunks``' host bytes into their arena bytes (``load``) or back, on the current
    stream (a capture's: inside a graph, no other stream orders them); ``after[i]``: an event
    the copy of ``chunks[i]`` waits for first (None: none); ``first``: events every copy
    waits for."""
    stream = torch.cuda.current_stream(sched.device) if sched.cuda else None
    for event in first:
        stream.wait_event(event)
    for i, chunk in enumerate(chunks):
        event = after[i] if after else None
        if event is not None:
            stream.wait_event(event)
        for host, staged in sched._staged(chunk)[1]:
            if load:
                staged.copy_(host, non_blocking=sched.cuda)
            else:
                host.copy_(staged, non_blocking=sched.cuda)


class SplitStep:
    """The head, main and tail graphs of one step (``StepGraphs`` sees one graph:
    ``capture(body)``, ``replay()``, ``reset()``), and ``prefetch()``, the head's replay."""

    def __init__(self, new_graph: Callable[[], object], sched, transfers, side) -> None:
        self.sched, self.transfers, self.side = sched, transfers, side
        self.head, self.main, self.tail = new_graph(), new_graph(), new_graph()
        self._head_end = torch.cuda.Event() if sched.cuda else None
        self._split = None  # the last capture's: its events live as long as the graphs
        # Head replays from prefetch() (under backward) and by the step itself (nothing
        # prefetched, or an eager run took the arena since): graph_stats() shows both.
        self.heads_ahead = self.heads_at_step = 0

    @property
    def pool_bytes(self) -> int:
        return sum(getattr(g, "pool_bytes", 0) for g in (self.head, self.main, self.tail))

    def capture(self, body: Callable[[], None]) -> None:
        """Capture the three (``body``: the step's run)."""
        sched = self.sched
        streamed = sched.prepare(self.transfers, self.side)
        n = prefetch.first_loads(sched.layout)
        self.head.capture(lambda: _copy(sched, streamed[:n], True))
        split = self._split = sched.ahead.split = prefetch.Split(n, tail_of(sched.layout))
        try:
            self.main.capture(body)
        finally:
            sched.ahead.split = None
        self.tail.capture(lambda: _copy(sched, split.deferred, False, split.updated, split.stored))

    def prefetch(self) -> bool:
        """Replay the head (once before each main replay) on the h2d stream."""
        if self.sched.ahead.headed is not self.head:
            self._replay_head(False)
        return True

    def _replay_head(self, at_step: bool) -> None:
        sched = self.sched
        if at_step:
            self.heads_at_step += 1
        else:
            self.heads_ahead += 1
        if sched.cuda:
            h2d = sched.h2d_stream
            if at_step or not sched.ahead.open:
                h2d.wait_stream(torch.cuda.current_stream(sched.device))
            prefetch.wait_stores(sched)  # the last tail's end
            with torch.cuda.stream(h2d):
                self.head.replay()
            self._head_end.record(h2d)
        else:
            self.head.replay()
        sched.ahead.headed = self.head  # till the main replay, or another run, takes the arena

    def replay(self) -> None:
        """The step: the head (unless prefetched), the main graph on the current stream, the
        tail on the d2h stream, its stores after their updates in the main graph, left
        running."""
        sched = self.sched
        if sched.ahead.headed is not self.head:  # not prefetched, or an eager run since
            self._replay_head(True)
        sched.ahead.headed = None
        sched.ahead.runs += 1  # the backward hook prefetches once a run
        if not sched.cuda:
            self.main.replay()
            self.tail.replay()
            return
        compute, d2h = torch.cuda.current_stream(sched.device), sched.d2h_stream
        compute.wait_event(self._head_end)
        self.main.replay()
        with torch.cuda.stream(d2h):  # launched after the main graph: waits for its records
            self.tail.replay()
        prefetch.record_stores(sched, [d2h])

    def reset(self) -> None:
        for graph in (self.head, self.main, self.tail):
            graph.reset()
