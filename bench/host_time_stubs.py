"""Stand-ins for ``host_time.py``: the kernels stubbed out (an update computes nothing) and a
CUDA graph that captures and replays nothing, so that what is timed on the CPU is the engine's
own host time."""

from __future__ import annotations

import contextlib

import torch

from muon_offload.engine import capture_rules, graphs
from muon_offload.optim import elementwise, muon_launch


@contextlib.contextmanager
def stubbed_kernels():
    """The launchers (``optim/muon_launch.py``, ``optim/elementwise.py``) replaced by ones that
    compute nothing: what is left of a step is the engine's host time."""

    def prep(backend, momentums, grads, *args, **kwargs):
        m = momentums[0]
        update = torch.empty((len(momentums), *m.shape), dtype=torch.bfloat16, device=m.device)
        return update, torch.empty(len(momentums), dtype=torch.float32, device=m.device)

    def nothing(*args, **kwargs):
        return None

    stubs = {
        (elementwise, "adamw_"): nothing,
        (elementwise, "lion_"): nothing,
        (elementwise, "adamw8_"): nothing,
        (elementwise, "lion8_"): nothing,
        (muon_launch, "muon_apply_"): nothing,
        (muon_launch, "muon_prep"): prep,
        (muon_launch, "muon_prep8"): lambda backend, codes, scales, grads, **kw: prep(
            backend, codes, grads
        ),
        (muon_launch, "orthogonalize_batch"): lambda update, sumsq, **kwargs: update,
        (muon_launch, "orthogonalize_apply_"): nothing,
    }
    saved = {(module, name): getattr(module, name) for module, name in stubs}
    for (module, name), fn in stubs.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


class _NoGraph:
    """A stand-in for a CUDA graph that captures and replays nothing: a replayed step's host
    time is then all that is timed (checks, state and plan lookups, the scalar table, the
    graph's key), without the launches a replay saves."""

    pool_bytes = 0

    def capture(self, body) -> None:
        pass

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        pass


class _NoGraphSteps(graphs.StepGraphs):
    """``StepGraphs`` whose graphs are ``_NoGraph``s, whatever the device."""

    def __init__(self, device, new_graph=None, **kwargs):
        super().__init__(device, _NoGraph, **kwargs)


@contextlib.contextmanager
def replayed(opt):
    """``opt`` (Triton backend, kernels stubbed) as with ``cuda_graph=True``, its graph a
    ``_NoGraph``: the CPU stands in for the GPU (the device check is the one thing bypassed).
    ``opt`` must not have stepped with graphs yet: the graphs it makes in the block are
    ``_NoGraphSteps``."""
    saved = capture_rules.check_device, graphs.StepGraphs
    capture_rules.check_device = lambda cuda_graph, device: None
    graphs.StepGraphs = _NoGraphSteps
    opt.cuda_graph = True
    try:
        with stubbed_kernels():
            yield
        stats = opt.graph_stats()
        if stats["off"] or not stats["replays"]:
            raise RuntimeError(f"the timed steps did not replay: {stats}")
    finally:
        capture_rules.check_device, graphs.StepGraphs = saved
