"""Offloaded state loaded ahead of ``step()``, and stores left to finish under what follows it.

A step streams offloaded state through the staging arena (``scheduler.py``): chunk i + 1 loads
while chunk i updates and chunk i - 1 is written back. Two ends of that pipeline have nothing
beside them, the first loads and the last stores, so:

- ``prefetch()`` (the optimizer's) queues now, on the h2d stream, the loads the next step would
  queue first: those of the cached plan (the last step's) that fit in the arena before it wraps
  (the loads a step queues before any of its stores, ``ArenaLayout.issue_after`` < 0). The
  budget is the arena's bytes: nothing is allocated, nothing is held past the next step. The
  next run takes them (``take``) when it runs the same transfers (the same plan's objects; a
  plan made afresh, after state was created, dropped, moved or loaded, or under new budgets,
  has new ones) and skips issuing them; otherwise they are dropped, and the run loads as it
  would, after them on the same h2d stream (their bytes are the arena's, rewritten in order).
- With ``prefetch=True`` (the default) an offloaded optimizer hooks each parameter's gradient
  accumulation (``register_post_accumulate_grad_hook``): the first hook starts the thread that
  queues the stores a replayed step held back, or queues them itself if they are few
  (``pace_tail``, tail_pacer.py), then the first hook after they are all queued calls
  ``prefetch()``, so the first loads run under the rest of backward.
- An eager step on CUDA, while no CUDA graph is in use, leaves its stores running: the compute
  stream waits for the updates (parameters written, ``leave_stores``), not for the write-backs
  (while graphs are in use an eager step joins them: the capture that may follow waits on no
  event recorded before it). The scheduler keeps an event at the end of the d2h stream's
  stores; the next run's loads and any prefetch wait for it (``wait_stores``),
  and whatever reads host state or gives staging bytes back waits on the host (``finish``, the
  optimizer's ``Streams.synchronize``: ``state_dict``, copies and saves, ``load_state_dict``,
  state dropped or moved, ``host_buffers``, ``reconfigure``). A step under CUDA graph capture joins
  every stream into the capturing one, as CUDA requires, and takes no load ``issue`` queued.
- With graphs in use, a step that streams state, prefetched, is captured as two graphs
  (``graph_ends.py``): a head graph of the loads ``issue`` would queue, which ``prefetch()``
  replays on the h2d stream while the graph is held, and the main graph (``Split``: its
  capture takes those loads and leaves the tail's stores out, ``defer``). The tail's stores
  are held after each replay (``hold_tail``) and queued in slices from the next backward
  (``pace_tail``), or all at once by whatever needs them first (``launch_tail``); their end
  is the event ``ahead.stored`` that the next loads and ``finish`` wait for, as an eager
  step's.

Without CUDA, ``issue`` copies at once and the run skips those copies: the same logic in plan
order, which CI tests.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from functools import partial

import torch

from . import graph_ends, tail_pacer


class Ahead:
    """A scheduler's loads queued ahead of its next run, and its last run's open stores."""

    def __init__(self) -> None:
        self.transfers = None  # the transfers (a plan's) the loads were queued for, and side
        self.side = None
        self.loads = 0  # how many of their first streamed chunks are loading
        self.runs = 0  # runs started: the backward hook prefetches once a run
        self.hooked_run = -1  # the run the last backward hook prefetched after
        self.stored = None  # an event at the end of the d2h stream's stores of the last run
        self.open = False  # the last run left its stores running (no error, no capture)
        self.leave = True  # whether the next run may leave them running (no graph in use)
        # Whether prefetch() was asked for (the backward hook's call or the user's) since the
        # last run started: a graph captured now is split (graph_ends.py); without it nothing
        # runs beside the step's ends, and the step is captured whole.
        self.asked = False
        self.split = None  # while a step's main graph is captured apart from its head graph
        # and its tail's stores (graph_ends.py): the ``Split`` the run reads
        self.headed = None  # the head graph (graph_ends.py) that loaded the arena last (its
        # main replay takes those loads); any run or ``issue`` rewrites the arena: None
        self.tail = None  # the stores the last main replay left out while held
        # (``HeldTail``): None once all are queued
        self.pacer = None  # the thread queueing them (tail_pacer.py), once started


class Split:
    """A run captured after a head graph and before its held tail: its first ``head``
    streamed chunks are loaded by the head graph, the stores of the streamed chunks in
    ``tail`` (by place among the streamed) are left out, the chunks listed in ``deferred``,
    stored after the events in ``updated`` that the main graph records at the end of their
    updates (``HeldTail``)."""

    def __init__(self, head: int, tail: frozenset) -> None:
        self.head, self.tail = head, tail
        self.deferred: list[int] = []  # chunk indices, in run order
        # External events (CUDA): recorded by the main graph's replay, waited for by the
        # tail's first slice; None on the CPU. Kept as long as the graphs that name them.
        self.updated: list = []
        # One external event a store stream of the run, recorded after its last store in the
        # main graph: the tail's first slice waits for them all (``stores_end``).
        self.stored: list = []


def defer(sched, k: int, chunk: int, stream=None) -> bool:
    """Whether the store of the k-th streamed chunk (``chunk``) is left out of a main graph
    (to its held tail); if so, its update's end on ``stream`` (CUDA) is recorded for the
    tail's first slice to wait for."""
    split = sched.ahead.split
    if split is None or k not in split.tail:
        return False
    split.deferred.append(chunk)
    event = None
    if stream is not None:
        # An external event: captured as a record node of the main graph, waited for by the
        # tail's first slice outside it (an internal one cannot be named outside the graph).
        event = torch.cuda.Event(external=True)
        event.record(stream)
    split.updated.append(event)
    return True


def stores_end(sched) -> None:
    """At the end of a main graph's capture: record an external event after the last store
    queued on the d2h stream, for the tail to wait for first.

    The copy engine that writes device bytes to the host runs the copies of every stream,
    roughly in the order they become ready: a tail store queued beside the main graph's own
    would take the engine from a store that a load of the step waits for, while the tail's
    are needed by no one before the next step. On the H200, an MoE step with 3 GiB loaded
    ahead took 115 ms with its tail's stores beside its own and 58 ms with them after."""
    split = sched.ahead.split
    if split is None or not sched.cuda:
        return
    event = torch.cuda.Event(external=True)
    event.record(sched.d2h_stream)
    split.stored.append(event)


def issue(sched, transfers, side) -> int:
    """Queue the loads of the first streamed chunks of ``transfers`` that fit in the arena
    before it wraps, ordered after the last run's stores; return how many."""
    ahead = sched.ahead
    if ahead.transfers is transfers and ahead.side is side:
        return ahead.loads  # queued already
    streamed = sched.prepare(transfers, side)
    n = first_loads(sched.layout)
    if sched.cuda and not ahead.open:  # the last run ended joined into its caller's stream
        sched.h2d_stream.wait_stream(torch.cuda.current_stream(sched.device))
    wait_stores(sched)  # the host bytes final and the arena's free
    for k in range(n):
        sched._load(k, streamed[k])
    ahead.transfers, ahead.side, ahead.loads, ahead.headed = transfers, side, n, None
    return n


def first_loads(layout) -> int:
    """How many of the first streamed chunks load before the arena wraps (no store first)."""
    after, n = layout.issue_after, 0
    while n < len(after) and after[n] < 0:
        n += 1
    return n


def take(sched, transfers, side, capturing: bool) -> int:
    """At the start of a run: how many of its first streamed chunks are loaded already (0 when
    none were queued, they were for other transfers, or the run is captured: dropped); the
    run's own loads are ordered after the last run's stores (not under capture: a capture
    starts after a device sync, and may wait on no event recorded outside it)."""
    ahead = sched.ahead
    same = ahead.transfers is transfers and ahead.side is side and not capturing
    n = ahead.loads if same else 0
    ahead.transfers = ahead.side = ahead.headed = None
    ahead.loads, ahead.open, ahead.asked = 0, False, False
    if ahead.split is not None:  # a main graph's capture: the head graph's loads; its
        return ahead.split.head  # replays count the runs (graph_ends.py)
    ahead.runs += 1
    if not capturing:
        wait_stores(sched)
    return n


def wait_stores(sched) -> None:
    """The h2d stream waits for the stores the last runs left running (a held tail's
    launched first)."""
    launch_tail(sched)
    if sched.ahead.stored is not None:
        sched.h2d_stream.wait_event(sched.ahead.stored)


class HeldTail:
    """The stores a replayed main graph left out (graph_ends.py): ``runs``, (host bytes, arena
    bytes) in run order, issued in slices on the d2h stream, the first after ``waits`` (the
    main graph's external events: each chunk's update, the last store)."""

    def __init__(self, runs: list, waits: list) -> None:
        self.runs, self.waits = runs, waits
        self.run = self.offset = 0  # the next byte to store: runs[run][offset]
        self.started = False

    def left(self) -> int:
        """The bytes not queued yet."""
        return sum(host.numel() for host, _ in self.runs[self.run :]) - self.offset

    def issue(self, sched, budget: int | None) -> bool:
        """Queue the next ``budget`` bytes of stores (None: all the rest) on the d2h stream;
        return whether every store is queued."""
        cuda, runs = sched.cuda, self.runs
        with torch.cuda.stream(sched.d2h_stream) if cuda else nullcontext():
            if cuda and not self.started:
                for event in self.waits:
                    sched.d2h_stream.wait_event(event)
            self.started = True
            while self.run < len(runs) and (budget is None or budget > 0):
                host, staged = runs[self.run]
                end = host.numel() if budget is None else min(host.numel(), self.offset + budget)
                host[self.offset : end].copy_(staged[self.offset : end], non_blocking=cuda)
                if budget is not None:
                    budget -= end - self.offset
                done = end == host.numel()
                self.run, self.offset = (self.run + 1, 0) if done else (self.run, end)
        complete = self.run == len(runs)
        if cuda and complete:  # the tail's end; nothing waits for it before (launch_tail)
            record_stores(sched)
        return complete


def hold_tail(sched, tail: HeldTail) -> None:
    """After a main graph's replay: its left-out stores are held, not queued, until the next
    backward's first gradient hook starts a thread that queues them in slices, or queues them
    itself if they are few (``pace_tail``, tail_pacer.py), or something needs them all
    (``launch_tail``): the next head's loads, a run's, a host reader (``finish``), the graphs
    dropped.

    Queued at once, under the next forward, they held every small copy to the host that the
    forward waits for (an MoE's routing, ``.item()``) behind them on the one copy engine that
    runs device-to-host copies: on the H200 an MoE forward took 154 ms after 3 GiB of them
    instead of 123; queued at once in backward, they held backward's (torch's ``_grouped_mm``
    reads its offsets on the host): 228 ms instead of 171."""
    sched.ahead.tail = tail
    sched.ahead.open = True


def pace_tail(sched) -> bool:
    """From a gradient hook: start the thread that queues the held tail's stores
    (tail_pacer.py) if none runs. Return whether none is left to queue (then the next step's
    first loads may be).

    A tail of at most ``PACE_DEPTH`` slices the hook queues itself: the thread would queue it
    all before its first wait, and a small model's few hooks may all come before the thread
    has run, leaving its head to the step."""
    ahead = sched.ahead
    if ahead.tail is None:
        return True
    if ahead.pacer is None:
        if ahead.tail.left() > tail_pacer.PACE_DEPTH * tail_pacer.PACE_SLICE_BYTES:
            ahead.pacer = tail_pacer.TailPacer(sched, ahead.tail)
            return False
    elif not ahead.pacer.done:
        return False
    launch_tail(sched)  # a small tail, or the rest after the thread's end (none)
    return True


def launch_tail(sched) -> bool:
    """Queue all of the held tail's stores left, if one is held; return whether one was."""
    ahead = sched.ahead
    tail, ahead.tail, pacer, ahead.pacer = ahead.tail, None, ahead.pacer, None
    # The thread ended where it is: the rest is queued here, in order (after an error in it
    # too: no store is dropped), then its error raised.
    error = pacer.stop() if pacer is not None else None
    if tail is None:
        return False
    tail.issue(sched, None)
    if error is not None:
        raise error
    return True


def settle_tail(sched) -> None:
    """Queue what is left of a held tail and wait on the host for its stores (a read of
    host state)."""
    if launch_tail(sched) and sched.cuda:
        sched.ahead.stored.synchronize()


def leave_stores(sched, forked: list) -> list:
    """At the end of an eager run that raised nothing: record the d2h stream's end and
    return the forked streams the caller's stream still waits for (loads, side updates)."""
    record_stores(sched)
    return [s for s in forked if s is not sched.d2h_stream]


def record_stores(sched) -> None:
    """Record the end of the d2h stream's stores, left running: the next loads wait for it."""
    ahead = sched.ahead
    if ahead.stored is None:
        ahead.stored = torch.cuda.Event()
    ahead.stored.record(sched.d2h_stream)
    ahead.open = True


def finish(sched) -> None:
    """Launch a held tail, then wait on the host for the caller's stream and every stream of
    ``sched`` (CUDA)."""
    launch_tail(sched)
    if not sched.cuda:
        return
    torch.cuda.current_stream(sched.device).synchronize()
    for stream in sched._forked(True):
        stream.synchronize()


def _grad_ready(ref: weakref.ref, param) -> None:
    """A parameter's gradient accumulated: the first one after a run prefetches."""
    prefetcher = ref()
    if prefetcher is not None:
        prefetcher.grad_ready()


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()


class Prefetcher:
    """``prefetch()`` (the optimizer's method of that name is this one's) and its backward
    hooks, which hold this object weakly and go when it does (with the optimizer)."""

    def __init__(self, settings, streams, plans, store, handed_scales, graphing) -> None:
        self._settings, self._streams, self._plans = settings, streams, plans
        self._store, self._handed_scales, self._graphing = store, handed_scales, graphing
        self._hooks: list = []
        self._hooked: set[int] = set()  # ids of the parameters hooked
        weakref.finalize(self, _remove, self._hooks)

    def prefetch(self) -> bool:
        """Start loading the next step's first chunks of offloaded state now, so that
        ``step()`` does not wait for them; return whether any load was queued. The next step
        uses them if it runs the same plan as the last step (the same parameters with
        gradients, budgets and state), and loads afresh otherwise. Nothing to do (False)
        before the first step, without streamed state, while CUDA graphs are in use and no
        graph of the last step's plan is held (while one is, its head graph is replayed:
        graph_ends.py), and while 8-bit scales handed out by ``state_dict()`` may still be
        written into (they are copied in at the next step)."""
        sched, last = self._streams.scheduler, self._plans.last
        if sched is not None:
            sched.ahead.asked = True
        if sched is None or last is None or not self._store.streamed or self._handed_scales.held:
            return False
        _, transfers, _, side, _ = last[1]
        if self._graphing.in_use(sched.device):
            held = self._graphing.graphs and self._graphing.graphs.held
            split = isinstance(held, graph_ends.SplitStep) and held.sched is sched
            return split and held.transfers is transfers and held.prefetch()
        return issue(sched, transfers, side) > 0

    def grad_ready(self) -> None:
        sched = self._streams.scheduler
        if sched is None or not pace_tail(sched):  # the last step's stores first
            return
        # Counted on the scheduler's own ``Ahead``: new budgets make a new scheduler, whose
        # runs count from 0 again.
        if sched.ahead.runs != sched.ahead.hooked_run:
            sched.ahead.hooked_run = sched.ahead.runs
            self.prefetch()

    def hook(self, params) -> None:
        """With ``prefetch`` and offloaded state: hook every parameter of ``params`` not hooked
        yet that takes gradients."""
        settings = self._settings.now
        if not (settings.offload and settings.prefetch):
            return
        hook = partial(_grad_ready, weakref.ref(self))
        for p in params:
            if p.requires_grad and id(p) not in self._hooked:
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))
                self._hooked.add(id(p))
