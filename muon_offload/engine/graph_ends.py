"""A captured step that streams state, as two CUDA graphs and the stores they leave out: its
first loads run under backward and its last stores under the next backward, as an eager
step's run beside what follows it (prefetch.py).

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
  finish. They are not captured: after each main replay they are held (``prefetch.HeldTail``)
  and queued in small slices from the next backward, by a thread its first gradient hook
  starts (``prefetch.pace_tail``, tail_pacer.py; a tail of two slices or less by the hook),
  two slices ahead of the one it waits for, so that no small copy to the host that the
  forward or backward waits for (an MoE's routing) queues behind all of them on the copy
  engine. The first slice waits for external events that the main graph records (CUDA's
  event record nodes): each tail chunk's update end, and the main graph's last store
  (``prefetch.stores_end``).

Head and main are captured as the main graph alone was (graphs.py), in one step, under one
key: a key change drops both (the held stores queued first), a capture miss in either gives
graphs up. Their replays, and the tail, are ordered by plain events recorded and waited on
outside any capture:

    h2d stream       [waits: tail's end] head  (from prefetch(): under backward)
    compute stream   ... backward ... [waits: head's end] main | forward ... backward ...
    d2h stream                                        tail's slices, from backward on

- The head's loads write arena bytes and read host state: the last step's tail is queued in
  full and ends first (and through it every update and store of a streamed chunk of that
  step: its first slice waits for the main graph's records); backward's work is not
  waited for, except when the step replays the head itself (no ``prefetch()`` before it), or
  the last step joined its stores (eager, or a capture): then the h2d stream waits for
  whatever the compute stream queued before, as ``prefetch.issue`` does.
- The main graph follows the head (its updates read the head's bytes; its own loads take
  bytes whose last holders it waits for inside the graph, after the head's chunks).
- The tail's end is what the next head, an eager step's loads (``prefetch.take``), and every
  host reader (``finish``: the d2h stream) wait for, as ``ahead.stored``; each queues what is
  left of it first (``prefetch.launch_tail``), and ``opt.state`` waits for it on the host.

Only a step whose first loads were asked for ahead (``prefetch()``, the backward hook: the
scheduler's ``ahead.asked``) is split (graph_runner.py): without anything beside its ends, one
graph of the step overlaps them with its own updates, which the split cannot (the main graph
waits for all of the head's loads; the tail starts after the main graph's end).

Nothing more is staged: the head and tail read and write the arena's bytes of the main graph.
Without CUDA the same code runs in order (the CPU tests' stand-in graphs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import prefetch


def tail_of(layout) -> frozenset[int]:
    """The streamed chunks (by place) whose stores no load of the run waits for."""
    taken = set().union(*layout.waits)
    return frozenset(k for k in range(len(layout.offsets)) if k not in taken)


def _load(sched, chunks: list[int]) -> None:
    """Copy ``chunks``' host bytes into their arena bytes on the current stream (a capture's:
    inside a graph, no other stream orders them)."""
    for chunk in chunks:
        for host, staged in sched._staged(chunk)[1]:
            staged.copy_(host, non_blocking=sched.cuda)


class SplitStep:
    """The head and main graphs of one step and its tail's runs (``StepGraphs`` sees one
    graph: ``capture(body)``, ``replay()``, ``reset()``), and ``prefetch()``, the head's
    replay."""

    def __init__(self, new_graph: Callable[[], object], sched, transfers, side) -> None:
        self.sched, self.transfers, self.side = sched, transfers, side
        self.head, self.main = new_graph(), new_graph()
        self._head_end = torch.cuda.Event() if sched.cuda else None
        self._split = None  # the last capture's: its events live as long as the graphs
        self._tail_runs: list = []  # (host bytes, arena bytes) of the tail's chunks
        self._tail_waits: list = []  # the main graph's records its first slice waits for
        # Head replays from prefetch() (under backward) and by the step itself (nothing
        # prefetched, or an eager run took the arena since): graph_stats() shows both.
        self.heads_ahead = self.heads_at_step = 0

    @property
    def pool_bytes(self) -> int:
        return sum(getattr(g, "pool_bytes", 0) for g in (self.head, self.main))

    def capture(self, body: Callable[[], None]) -> None:
        """Capture the two (``body``: the step's run) and note the tail's runs."""
        sched = self.sched
        streamed = sched.prepare(self.transfers, self.side)
        n = prefetch.first_loads(sched.layout)
        self.head.capture(lambda: _load(sched, streamed[:n]))
        split = self._split = sched.ahead.split = prefetch.Split(n, tail_of(sched.layout))
        try:
            self.main.capture(body)
        finally:
            sched.ahead.split = None
        self._tail_runs = [run for c in split.deferred for run in sched._staged(c)[1]]
        self._tail_waits = [*split.stored, *(e for e in split.updated if e is not None)]

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
        prefetch.launch_tail(sched)  # the last tail's stores first (their bytes are reloaded)
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
        tail's stores held (after their updates in the main graph: its records)."""
        sched = self.sched
        if sched.ahead.headed is not self.head:  # not prefetched, or an eager run since
            self._replay_head(True)
        sched.ahead.headed = None
        sched.ahead.runs += 1  # the backward hook prefetches once a run
        if sched.cuda:
            torch.cuda.current_stream(sched.device).wait_event(self._head_end)
        self.main.replay()
        prefetch.hold_tail(sched, prefetch.HeldTail(self._tail_runs, self._tail_waits))

    def launch_tail(self) -> None:
        """Queue this step's tail if it is still held (before the graphs go: nothing lost;
        a held tail of its scheduler is this step's, the one graph held)."""
        prefetch.launch_tail(self.sched)

    def reset(self) -> None:
        for graph in (self.head, self.main):
            graph.reset()
