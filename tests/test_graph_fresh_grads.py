"""CUDA graphs with torch's default ``zero_grad()``: backward allocates every gradient afresh
each step, and the kernels read their addresses from the step's gradient table
(engine/grad_table.py), so the graph's key holds and the step replays. On the CPU, with a
stand-in graph that does what a CUDA graph does (tests/_graph_emulator.py: a replay reruns the
captured launches and operations on the captured arguments, not the step's Python), so a
replay that read the capture's gradients would give other bits than its eager twin. On a GPU:
test_gpu_graph.py::test_default_zero_grad_loop_replays_bitwise."""

import pytest
import torch
from _graph_emulator import RecordingGraph

from muon_offload import Muon
from muon_offload.engine import capture_rules
from muon_offload.engine.graphs import MAX_MISSES, StepGraphs

# A 3-D stack (three matrices in one parameter); an element-wise tensor that the offloaded
# runs' small chunks cut into segments; both with bf16 gradients (2-byte offsets).
SHAPES = ((24, 40), (24, 40), (40, 24), (3, 8, 16), (300,), (5,))
# 8-bit state from 4,096 elements on.
INT8_SHAPES = ((64, 80), (64, 80), (40, 64), (2, 64, 80), (4500,), (4200,))
BF16_GRADS = {3: torch.bfloat16, 4: torch.bfloat16}


def _muon(params, monkeypatch, made, graphed, **kw):
    groups = [
        dict(params=params[:4]),
        dict(params=params[4:5], algorithm="adamw", lr=3e-3),
        dict(params=params[5:], algorithm="lion", lr=1e-3),
    ]
    opt = Muon(groups, lr=0.02, backend="triton", cuda_graph=False, **kw)
    if graphed:  # the CPU stands in for the GPU: the device check is the one thing bypassed
        monkeypatch.setattr(capture_rules, "check_device", lambda cuda_graph, device: None)
        opt.cuda_graph = True

        def new_graph():
            made.append(RecordingGraph())
            return made[-1]

        opt._graphing.graphs = StepGraphs(torch.device("cpu"), new_graph)
    return opt


def _pair(monkeypatch, made, shapes=SHAPES, **kw):
    """A graphed optimizer and its eager twin, on equal parameters."""
    pair = []
    for graphed in (True, False):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        pair.append((_muon(params, monkeypatch, made, graphed, **kw), params))
    return pair


def _backward(params, step, dtypes):
    """A backward pass after torch's default zero_grad(): every gradient a new tensor."""
    gen = torch.Generator().manual_seed(100 + step)
    loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
    loss.backward()
    for i, dtype in dtypes.items():
        if hasattr(params[i], "grad_dtype"):  # torch >= 2.12 asks first
            params[i].grad_dtype = None
        params[i].grad = params[i].grad.to(dtype)


def _run(pair, steps, dtypes=BF16_GRADS, between=None):
    for s in steps:
        for opt, params in pair:
            _backward(params, s, dtypes(s) if callable(dtypes) else dtypes)
            if between is not None:
                between(s, params)
            opt.param_groups[0]["lr"] *= 0.9  # a schedule: read from the scalar table
            opt.step()
            opt.zero_grad()  # set_to_none=True: the next backward allocates afresh
    (opt_a, a), (opt_b, b) = pair
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        for k in opt_a.state[p]:
            assert torch.equal(opt_a.state[p][k], opt_b.state[q][k]), k
    return opt_a.graph_stats()


@pytest.mark.parametrize(
    ("shapes", "kw"),
    [
        (SHAPES, {}),
        (SHAPES, {"offload": True, "chunk_bytes": 6000}),
        (SHAPES, {"state_dtype": torch.bfloat16}),
        (INT8_SHAPES, {"state_dtype": torch.int8}),
    ],
)
def test_fresh_gradients_capture_once_and_replay_bitwise(monkeypatch, shapes, kw):
    made = []
    stats = _run(_pair(monkeypatch, made, shapes, **kw), range(5))
    # 0 eager, 1 capture (and its replay), 2-4 replay: no step misses for new gradients
    assert (stats["captures"], stats["replays"], stats["eager_steps"]) == (1, 3, 1)
    # An offloaded step: its head and main graphs (engine/graph_ends.py)
    assert len(made) == (2 if kw.get("offload") else 1) and stats["off"] is None
    assert all(graph.replays == 4 for graph in made)


def test_a_gradient_dtype_change_recaptures(monkeypatch):
    """The kernels are compiled for the gradients' dtypes: a graph captured with bf16
    gradients cannot replay fp32 ones."""
    made = []
    pair = _pair(monkeypatch, made)
    stats = _run(pair, range(6), dtypes=lambda s: BF16_GRADS if s < 3 else {})
    # 0 eager, 1 capture, 2 replay, 3 fp32: dropped, eager, 4 capture, 5 replay
    assert made[0].was_reset and (stats["captures"], stats["replays"]) == (2, 2)


def test_a_gradient_that_loses_its_alignment_recaptures(monkeypatch):
    """A gradient 4 bytes past a 16-byte boundary (a view into a larger buffer): the kernels
    were compiled for 16-byte accesses to the old one."""
    made = []

    def misalign(step, params):
        if step >= 3:
            g = params[4].grad
            buffer = torch.empty(g.numel() + 1, dtype=g.dtype)
            params[4].grad = buffer[1:].view_as(g).copy_(g)

    stats = _run(_pair(monkeypatch, made), range(6), between=misalign)
    # 0 eager, 1 capture, 2 replay, 3 misaligned: dropped, eager, 4 capture, 5 replay
    assert made[0].was_reset and (stats["captures"], stats["replays"]) == (2, 2)


def test_which_parameters_have_gradients_still_decides(monkeypatch):
    made = []

    def drop_one(step, params):
        if step == 3:
            params[2].grad = None

    stats = _run(_pair(monkeypatch, made), range(8), between=drop_one)
    # 0 eager, 1 capture, 2 replay; 3: another plan (eager); 4: the full plan again (eager),
    # 5 capture, 6-7 replay
    assert made[0].was_reset and stats["captures"] == 2 and stats["replays"] == 3


def test_non_contiguous_gradients_run_eagerly_and_exactly(monkeypatch):
    """A transposed gradient is copied afresh each step: no table row can name it, so the
    launchers read the copy's address, the step runs eagerly (graphs given up) and exactly."""
    made = []

    def transpose(step, params):
        params[0].grad = params[0].grad.t().contiguous().t()

    stats = _run(_pair(monkeypatch, made), range(MAX_MISSES + 2), between=transpose)
    assert not made and "not contiguous" in stats["off"]
