"""A CUDA graph's stand-in for CPU tests that does what a CUDA graph does.

``capture(body)`` runs the step's Python once and records what it issues, the Triton launches
(under the interpreter) and the torch operations, executing none that writes; ``replay()``
runs exactly the recorded work again on the very tensors and arguments it was recorded with,
without the step's Python. So whatever the host read while capturing (an address in a pointer
table, a Python number, which tensor a launch is given) stays as it was, as on a GPU: a replay
that reads last step's gradient, or a stale value, gives other bits than the eager step.

What it records: a Triton launch with its arguments; an operation that writes (in place, or
into ``out=``) as it was called; a functional operation as "compute it again and write the
result where the capture's result lives" (a graph's kernel writes the same memory each
replay); allocations and views run at capture only (their memory stays the capture's). A read
of a tensor's value on the host under capture raises, as it would on a GPU. The recorded
tensors are held, so nothing is freed under a replay (a graph's pool does the same for its
temporaries; the test compares with an eager twin, so a stale read shows as other bits).

A collective (a ``c10d`` operation: gloo's on the CPU) is issued, not run, under capture: it
returns a finished stand-in of its work (its ``wait()`` orders nothing: nothing ran), and a
replay runs it on the captured tensors and waits for it there, as a graph's NCCL node is
ordered in its stream.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from triton.runtime.interpreter import InterpretedFunction

_HOST_READS = {"_local_scalar_dense", "equal", "is_nonzero"}


class _Recorder(TorchDispatchMode):
    def __init__(self, record: list):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _HOST_READS:
            raise RuntimeError(f"{func} reads a tensor's value on the host under capture")
        if func.namespace == "c10d":  # a collective: issued, not run, its work done
            self.record.append(lambda: _wait(func(*args, **kwargs)))
            return _finished(func, args)
        if func._schema.is_mutable:  # in place or out=: issued, not run (a capture runs nothing)
            self.record.append(lambda: func(*args, **kwargs))
            return kwargs.get("out", args[0])
        out = func(*args, **kwargs)
        if func.is_view or name.startswith(("empty", "new_empty")):
            return out  # aliases and fresh memory: nothing to issue
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]

        def again():
            for held, now in zip(results, tree_leaves(func(*args, **kwargs)), strict=True):
                held.copy_(now)

        self.record.append(again)
        return out


def _wait(out) -> None:
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.ScriptObject):
            leaf.wait()


def _finished(func, args):
    """What the collective returns: its work (done), after its output tensors where its
    schema returns them first (``allgather_``: the output lists, its first argument)."""
    work = torch._C._distributed_c10d.FakeWork().boxed()  # as the dispatcher passes works
    return work if len(func._schema.returns) == 1 else (args[0], work)


class RecordingGraph:
    """``capture(body)``, ``replay()``, ``reset()``: what ``StepGraphs`` asks of a graph."""

    def __init__(self):
        self.record: list | None = None
        self.replays, self.was_reset = 0, False

    def capture(self, body) -> None:
        record: list = []
        run = InterpretedFunction.run

        def launch(kernel, *args, grid, warmup, **kwargs):  # issued, not run
            record.append(lambda: run(kernel, *args, grid=grid, warmup=False, **kwargs))

        InterpretedFunction.run = launch
        try:
            with torch.no_grad(), _Recorder(record):
                body()
        finally:
            InterpretedFunction.run = run
        self.record = record

    def replay(self) -> None:
        if self.was_reset:  # as a CUDA graph's: nothing left to replay
            raise RuntimeError("replay of a graph after its reset()")
        self.replays += 1
        with torch.no_grad():
            for issue in self.record:
                issue()

    def reset(self) -> None:
        self.was_reset = True
