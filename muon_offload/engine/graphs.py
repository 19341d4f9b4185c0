"""CUDA graphs: the step's GPU work captured once as a CUDA graph and replayed.

The host time of a step is mostly kernel launches (thousands a step on large models); a replay
issues them all at once. ``cuda_graph="auto"`` (the default) captures wherever a graph can
run: parameters on CUDA, the Triton kernels, meshes (``distributed_mesh``, DTensors') that
run CUDA collectives through NCCL (within one process: collectives across processes are
captured with ``cuda_graph=True``), no ``closure``; elsewhere, and once graphs are given up,
the step stays eager without a word above the INFO log level. ``cuda_graph=True`` refuses
what cannot be captured instead, and warns when it gives up; ``False`` never captures. What a
step passes to its launches by value, the graph keeps, so:

- runtime scalars (learning rates, decays, bias corrections, mu, eps) are read by the kernels
  from the step's scalar table (``scalars.py``), which every step, eager or replayed, fills;
- gradients' addresses likewise, from the step's gradient table (``grad_table.py``): torch's
  default ``zero_grad()`` has backward allocate them afresh every step;
- everything else the graph captured by address or as a constant is the graph's key
  (``step_key``): the plan, every parameter's address, shape and dtype, every gradient's
  dtype and 16-byte alignment, every state tensor's address, the staging arena, the scalar
  and gradient tables' buffers, the backend and what each group's launches take as
  constants (``Algorithm.baked``: Muon's nesterov, ``adjust_lr``, ...). While the key holds,
  the graph replays; when it changes, the graph is dropped, the next step runs eagerly and
  the one after captures again. A plan made afresh (state created or loaded, new budgets) is
  a new key, so ``load_state_dict`` drops the graph.

Sequence (``StepGraphs.step``): eager steps until a step's key equals the last step's (state
exists, every kernel is compiled and tuned, every pointer table built), then capture (on a side
stream, where the eager steps also ran, as torch asks) and replay that step; replay after.
Nothing may allocate host memory, copy from pageable memory or tune under capture: a miss
raises ``CaptureMiss`` (kernels/_launch.py) and graphs are turned off, eagerly. After
``MAX_MISSES`` steps in a row that could not replay (a parameter moved every step, gradients
that are not contiguous), the optimizer stays eager (logged once: a warning with ``True``,
INFO with ``"auto"``).

A step that streams state, and whose first loads were asked for ahead (``prefetch()``, the
backward hook), is captured as two graphs and its last stores held, so that its first loads
run under backward and its last stores under the next backward (``graph_ends.py``): one key,
captured, replayed and dropped together (the held stores queued first). A step nobody
prefetched is captured whole (one graph overlaps its ends with its own updates).

Meshes: NCCL collectives are captured as graph nodes. Each rank decides alone when to capture
(its key may change at another step than another rank's), and the collectives stay paired:
a capture executes nothing and is replayed at once, before any other collective, so every
rank runs each step's collectives exactly once, in the step's order, eager or replayed (a
failed capture runs the step eagerly instead). The rank agreement (``rank_agreement.py``, a
CPU all-reduce) runs at the start of ``step()``, before this decision, never under capture.
A DTensor's addresses in the key are its shard's; the all-to-all buffers are temporaries of
the graph's pool, and the communicators' buffers stay the group's while it lives.

Pointer tables read by the graph are held with it (``TableCache.holding``); temporaries live in
the graph's private memory pool (``pool_bytes``: about one step's peak of temporaries; memory
that the forward and backward passes can no longer borrow from the caching allocator, which is
the price of ``"auto"``: ``cuda_graph=False`` gives it back).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from functools import partial
from itertools import chain
from typing import NamedTuple

import torch
from torch import Tensor

from ..distributed import local
from ..kernels._launch import TABLES
from .graph_ends import SplitStep
from .step_work import StepWork

log = logging.getLogger(__name__)

MAX_MISSES = 4  # steps in a row that could not replay before graphs are given up


class GraphKey(NamedTuple):
    plan: int  # id of the plan's chunk layouts (held with the graph: never reused meanwhile)
    params: tuple  # each parameter's address, shape, dtype
    grads: tuple  # the gradient table's key (GradTable.key), each gradient's dtype
    state: tuple  # each state tensor's address
    staging: tuple  # the staging arena: address and size (the chunks' places depend on it)
    table: tuple  # the scalar table's buffer: address, size
    baked: tuple  # backend; each group's algorithm and what its launches hold as constants


WHAT = {
    "plan": "the plan (state created or loaded, other parameters with gradients, new budgets)",
    "params": "the parameters' addresses, shapes or dtypes",
    "grads": "the gradients' dtypes or 16-byte alignment, or the gradient table",
    "state": "the state tensors' addresses",
    "staging": "the staging arena",
    "table": "the scalar table",
    "baked": "a setting the launches take as a constant (backend, nesterov, adjust_lr, ...)",
}


def step_key(
    work, layouts, hypers, state: dict, algorithms: dict, staging, table, backend: str, grads
) -> tuple[GraphKey | None, str]:
    """This step's key, or None and why the step cannot be captured. ``work``: the step's
    ``StepWork``, whose parameters, gradients, shapes and dtypes were read by its checks (the
    gradients' shapes are the parameters', or the checks would have raised). ``grads``: the
    gradient table's key for this step (``GradTable.key``; None: no table)."""
    if not isinstance(work, StepWork):
        work = StepWork(work).read()
    params = work.params
    if work.pointers is not None:  # read with the step's checks
        param_ptrs, _, contiguous = work.pointers
    else:
        # A DTensor's own data_ptr() is 0: its shard's address is what a graph reads.
        contiguous = all(local(g).is_contiguous() for g in work.grads)
        param_ptrs = tuple(_ptr(local(p)) for p in params)
    if not contiguous or work.copied:
        which = "parameter" if contiguous else "gradient"
        return None, f"a {which} is not contiguous (the step copies it afresh each time)"
    if grads is None:
        return None, "the kernels read the gradients' own addresses (no gradient table)"
    baked = (backend,) + tuple((h.algorithm, algorithms[h.algorithm].baked(h)) for h in hypers)
    # Every state tensor, parameter by parameter, key by key: C-level passes, no Python loop;
    # the dicts as the step found them (``StateBuilder.ensure``), else looked up.
    dicts = work.state_dicts or map(state.__getitem__, params)
    tensors = chain.from_iterable(map(dict.values, dicts))
    if not work.plain:  # DTensor state: its shard
        tensors = map(local, tensors)
    key = GraphKey(
        plan=id(layouts),
        params=(param_ptrs, work.shapes, work.dtypes),
        grads=(grads, work.grad_dtypes),
        state=tuple(map(_ptr, tensors)),
        staging=tuple((t.data_ptr(), t.numel()) for t in staging),
        table=(table.data_ptr(), table.numel()),
        baked=baked,
    )
    return key, ""


_ptr = Tensor.data_ptr


def changed(a: GraphKey, b: GraphKey) -> str:
    """What differs between two keys, in words."""
    return "; ".join(WHAT[f] for f in GraphKey._fields if getattr(a, f) != getattr(b, f))


def release_rng(device: torch.device) -> None:
    """After a failed capture: a capture registers the device's default CUDA generator, and
    when it ends in an error (an invalidated capture) torch (2.11) leaves the generator in
    capture mode, so every later random op on the device raises "Offset increment outside
    graph capture encountered unexpectedly" (the user's dropout too). Probe it (one number
    drawn); if it is stuck, give it a fresh copy of its state (seed and offset kept)."""
    try:
        torch.rand(1, device=device)
    except RuntimeError as err:
        if "outside graph capture" not in str(err):
            raise
        generator = torch.cuda.default_generators[torch.device(device).index or 0]
        generator.graphsafe_set_state(generator.clone_state())
        log.info("cuda_graph: the default CUDA generator was left in capture mode; reset")


class _CudaGraph:
    """A torch.cuda.CUDAGraph captured on a given side stream."""

    def __init__(self, stream: torch.cuda.Stream):
        self.graph = torch.cuda.CUDAGraph()
        self.stream = stream
        self.pool_bytes = 0

    def capture(self, body: Callable[[], None]) -> None:
        device = self.stream.device
        torch.cuda.synchronize(device)
        # No garbage collection inside the capture: a dead CUDA graph (anyone's) that the
        # collector frees there calls the driver in a way capture forbids, which invalidates
        # the capture (seen on the H200: "operation not permitted when stream is capturing
        # (function reset)", then the step's next launch failed). torch 2.11's
        # torch.cuda.graph no longer collects first: collect here, then hold it off.
        gc.collect()
        torch.cuda.empty_cache()  # as torch.cuda.graph does: the pool's growth is then ours
        before = torch.cuda.memory_reserved(device)
        collecting = gc.isenabled()
        gc.disable()
        try:
            # thread_local: another thread's CUDA calls (a DataLoader pinning memory) do not
            # invalidate this capture.
            with torch.cuda.graph(
                self.graph, stream=self.stream, capture_error_mode="thread_local"
            ):
                body()
        except BaseException:
            release_rng(device)
            raise
        finally:
            if collecting:
                gc.enable()
        self.pool_bytes = torch.cuda.memory_reserved(device) - before

    def replay(self) -> None:
        self.graph.replay()

    def reset(self) -> None:
        self.graph.reset()


class StepGraphs:
    """Decides, step by step, between eager, capture and replay, and keeps the graph.

    ``new_graph()`` makes an object with ``capture(body)``, ``replay()`` and ``reset()``
    (a CUDA graph on the GPU; tests pass a stand-in)."""

    def __init__(
        self,
        device: torch.device,
        new_graph: Callable[[], object] | None = None,
        give_up_level: int = logging.WARNING,
    ):
        self.device = torch.device(device)
        self.give_up_level = give_up_level  # INFO for "auto": nobody asked for graphs
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        # A partial, not a lambda of self: no reference cycle keeps a dropped optimizer's
        # graph alive until the collector frees it at some later time (maybe mid-capture).
        self._new_graph = new_graph or partial(_CudaGraph, self._stream)
        self._graph = None
        self._key: GraphKey | None = None
        self._holds: tuple = ()  # what the graph reads by address: layouts, pointer tables
        self._last: tuple[GraphKey | None, object] | None = None  # last step's key, layouts
        self.captures = self.replays = self.eager_steps = 0
        self.misses = 0  # steps in a row that could not replay
        self.off: str | None = None  # why graphs were given up, once they are

    @property
    def pool_bytes(self) -> int:
        return getattr(self._graph, "pool_bytes", 0)

    @property
    def held(self):
        """The graph held (a ``SplitStep`` for a step that streams state), or None."""
        return self._graph

    def stats(self) -> dict:
        graph = self._graph
        return {
            "captures": self.captures,
            "replays": self.replays,
            "eager_steps": self.eager_steps,
            "captured": graph is not None,
            "pool_bytes": self.pool_bytes,
            "off": self.off,
            # The held split step's head replays (graph_ends.py): from prefetch(), under
            # backward, and by the step itself, which then waits for all of its loads.
            "heads_ahead": getattr(graph, "heads_ahead", 0),
            "heads_at_step": getattr(graph, "heads_at_step", 0),
        }

    def step(self, key: GraphKey | None, why_not: str, layouts, body, ends=None) -> str:
        """Run the step's GPU work (``body``): "replay", "capture" (then replayed once),
        or "eager". ``ends``: (scheduler, transfers, side) of a step that streams state,
        captured as a head and a main graph (``graph_ends.SplitStep``)."""
        if self.off is not None:
            body()
            self.eager_steps += 1
            return "eager"
        if self._graph is not None and key == self._key:
            self._graph.replay()
            self.replays += 1
            self.misses = 0
            return "replay"
        last = self._last
        self._last = (key, layouts)  # holds the layouts: their id stays theirs
        if self._graph is not None:
            why_not = changed(key, self._key) if key is not None else why_not
            self.drop()
        elif key is not None and last is not None and last[0] == key:
            if self._capture(key, layouts, body, ends):
                return "capture"
            self._eager(body)  # graphs are off now
            return "eager"
        elif last is not None and key is not None and last[0] is not None:
            why_not = changed(key, last[0])
        if last is not None:  # a step ran before: this one could have replayed
            self.misses += 1
            if self.misses >= MAX_MISSES:
                self._give_up(f"{self.misses} steps in a row could not replay: {why_not}")
        self._eager(body)
        return "eager"

    def drop(self) -> None:
        """Forget the graph (its key no longer holds, or the state it read is gone)."""
        if self._graph is None:
            return
        if isinstance(self._graph, SplitStep):
            self._graph.launch_tail()  # its stores run before the graphs go
        if self._stream is not None:
            # A replay may still be running (a head or tail on the scheduler's streams): let
            # it finish before its pool is released.
            torch.cuda.synchronize(self.device)
        self._graph.reset()
        self._graph, self._key, self._holds = None, None, ()

    def _give_up(self, why: str) -> None:
        self.drop()
        self.off = why
        log.log(self.give_up_level, "cuda_graph: the step stays eager from now on (%s)", why)

    def _eager(self, body) -> None:
        """An eager step on the side stream that captures use (torch's warm-up rule)."""
        self.eager_steps += 1
        if self._stream is None:
            body()
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        try:
            with torch.cuda.stream(self._stream):
                body()
        finally:
            current.wait_stream(self._stream)

    def _capture(self, key: GraphKey, layouts, body, ends) -> bool:
        # Waits under capture may only name events recorded in it: every wait of the
        # scheduler's step names one recorded earlier in the same step (scheduler.py).
        graph = self._new_graph() if ends is None else SplitStep(self._new_graph, *ends)
        try:
            with TABLES.holding() as tables:
                graph.capture(body)
        except Exception as err:  # nothing ran: the step runs eagerly instead
            if ends is not None:
                graph.reset()  # what was captured of it (a head graph before the miss)
            self._give_up(f"the capture failed: {type(err).__name__}: {err}")
            return False
        self._graph, self._key, self._holds = graph, key, (layouts, tables)
        self.captures += 1  # misses stay: only a replay of an earlier capture clears them
        graph.replay()
        return True
