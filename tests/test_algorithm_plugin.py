"""An algorithm defined in this file alone, plugged into the engine through its one
registration (a ``ChunkedOptimizer`` subclass naming it in ``algorithms``, with the
``_read_hyper`` that reads its groups): Adafactor (Shazeer & Stern, 2018) without momentum,
relative step off (a fixed ``lr``), update clipping at ``d = 1``, decoupled weight decay and the
paper's decay of ``beta2``, ``beta2_t = 1 - t ** -0.8`` (``t``: the parameter's own step count,
which the engine keeps and checkpoints because the algorithm says it counts steps).

Its state is not shaped like its parameter: a 2-D parameter of shape (m, n) keeps a row vector
of m and a column vector of n (the factored second moment, kept as means, as transformers'
Adafactor keeps them: ``V = outer(R, C) / mean(R)``; a stack factors each matrix), a 1-D one an
unfactored second moment of its own shape. The state keys and their shapes
(``Algorithm.state_shapes``), what a parameter counts against the chunk budgets
(``budget_bytes``: the update's full-size fp32 temporaries, not its small state), how its units
are cut (``matrices``: never, the default) and its kernels (a torch update, ``backends``) all
come from the algorithm. Checked here: the same bits resident, offloaded, part resident and
chunked at several ``chunk_bytes`` (the chunk counts follow the algorithm's budget and cut
rules); equal to a float64 torch loop of the rule within fp32 rounding; state_dict round trips
bit for bit and resumes alike; a loaded state of the wrong shape is refused before anything is
written.

What the plug-in cannot do: its units are whole parameters (the row and column means span the
matrix), so one whose budget exceeds ``chunk_bytes`` gets a chunk of its own, and a stack is
not cut between its matrices either (the formats' views of a stack's matrices assume state
shaped like the parameter). Dense state only: block-scaled formats lay their blocks out over
tensors of the parameter's shape (a key of another shape would be one run of blocks, untried
here), and an element-wise algorithm's state must be shaped like its parameter (segments).
A DTensor sharded across ranks is refused at construction (``Algorithm.placement``'s default
for a whole-parameter rule, which has no collectives); a replicated one is updated where it
is. No Triton kernel, so no CUDA graph (``cuda_graph=True`` refuses launches that read no step
tables).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from _mixed_runs import same_state, same_tensors, state_copy

from muon_offload.engine import ChunkedOptimizer
from muon_offload.engine.algorithm import Algorithm, Hyper, StateKey, UnitJob

EPS1 = 1e-30  # the paper's epsilon_1, added to the squared gradient
CLIP = 1.0  # the paper's d: the update's RMS is clipped to at most d
DECAY = 0.8  # beta2_t = 1 - t ** -DECAY (the paper's schedule)
# Full-size fp32 temporaries one item's update holds at once (g^2, the update and one of
# V / its factors' outer product): what a parameter counts against the budgets.
WORK_BUFFERS = 3


@dataclass(frozen=True)
class AdafactorHyper(Hyper):
    clip: float = CLIP
    decay: float = DECAY


class AdafactorUpdate(Algorithm):
    name = "adafactor"
    elementwise = False  # whole parameters: the row and column means span the matrix
    counts_steps = True  # beta2_t reads each parameter's own count
    state_kinds = ("adafactor_v", "adafactor_v", "adafactor_v")
    backends = ("torch",)

    def state_shapes(self, shape: torch.Size) -> tuple[StateKey, ...]:
        """Factored over the last two dims (leading ones batch matrices, as in transformers'
        Adafactor): rows ``shape[:-1]``, columns ``shape[:-2] + shape[-1:]``."""
        row, col, full = self.state_keys
        if len(shape) >= 2:
            kind = self.state_kinds[0]
            return (StateKey(row, kind, shape[:-1]), StateKey(col, kind, shape[:-2] + shape[-1:]))
        return (StateKey(full, self.state_kinds[2], shape),)

    def budget_bytes(self, state_bytes: int, numel: int, mesh_size: int) -> int:
        return max(state_bytes, -(-(WORK_BUFFERS * 4 * numel) // mesh_size))

    def update(self, job: UnitJob) -> None:
        h = job.hyper
        beta2 = 1.0 - job.step**-h.decay
        for x, g, *state in zip(job.params, job.grads, *job.state, strict=True):
            g2 = g.float().square().add_(h.eps)
            if x.ndim >= 2:
                row, col = state
                row.mul_(beta2).add_(g2.mean(dim=-1), alpha=1.0 - beta2)
                col.mul_(beta2).add_(g2.mean(dim=-2), alpha=1.0 - beta2)
                r = row / row.mean(dim=-1, keepdim=True)
                v = r.unsqueeze(-1) * col.unsqueeze(-2)
            else:
                (v,) = state
                v.mul_(beta2).add_(g2, alpha=1.0 - beta2)
            u = g.float() / v.sqrt()
            u.div_((u.square().mean().sqrt() / h.clip).clamp(min=1.0))
            x.mul_(1.0 - h.lr * h.weight_decay).sub_(u, alpha=h.lr)


class Adafactor(ChunkedOptimizer):
    algorithms = {"adafactor": AdafactorUpdate(("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"))}

    def __init__(self, params, lr=0.01, weight_decay=0.0, **engine):
        defaults = dict(lr=lr, weight_decay=weight_decay, algorithm="adafactor", step=0)
        settings = dict(offload=False, chunk_bytes=None, resident_bytes=0, state_dtype=None)
        super().__init__(params, defaults, **{**settings, **engine}, backend="torch")

    def _read_hyper(self, group: dict, index) -> Hyper:
        for p in group["params"]:
            if p.ndim < 1:
                raise ValueError(f"param group {index}: Adafactor takes no 0-d parameters")
        return AdafactorHyper(
            "adafactor", float(group["lr"]), float(group["weight_decay"]), eps=EPS1
        )


# Odd sizes; two parameters of one shape share a unit (a batch) unless a chunk cuts them apart.
SHAPES = [(37, 53), (101,), (37, 53), (19, 70), (33,), (3, 11, 17)]
HYPER = dict(lr=0.01, weight_decay=0.1)
STEPS = 4
SKIPS = {(2, 1)}  # (step, parameter) without a gradient: its count does not advance


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grad(step: int, i: int):
    gen = torch.Generator().manual_seed(1000 * step + i)
    return torch.randn(SHAPES[i], generator=gen) * (i + 1)


def _steps(params, opt, start, count):
    for s in range(start, start + count):
        for i, p in enumerate(params):
            p.grad = None if (s, i) in SKIPS else _grad(s, i)
        opt.step()


def _chunks(opt) -> int:
    return len(opt._plans.last[1][0].chunks)  # the last step's plan


# Each parameter counts 3 x 4 bytes an element against the budgets (37 x 53: 23,532 bytes; 19 x
# 70: 15,960; the stack: 6,732), its state far less (37 x 53: 360 bytes): a budget of 25,000
# holds one 37 x 53 matrix, where counted in state bytes all six parameters would share a chunk.
# The stack is never cut between its matrices (the algorithm's ``matrices`` is 1): at
# chunk_bytes=1 it is one chunk, where Muon's stack rule would make three.
RUNS = [
    (dict(offload=False, resident_chunk_bytes=1), 6),  # a chunk each
    (dict(offload=True), 1),
    (dict(offload=True, chunk_bytes=1), 6),  # each over budget: a chunk of its own
    (dict(offload=True, chunk_bytes=25_000), 3),  # [37x53], [37x53, 101], [19x70, 33, stack]
    # Resident (500 bytes of state): the first matrix and the 33-vector; the rest streamed.
    (dict(offload=True, chunk_bytes=60_000, resident_bytes=500), 2),
]


def test_state_is_shaped_by_the_algorithm():
    params = _params()
    opt = Adafactor(params, **HYPER)
    shapes = [{k: tuple(v.shape) for k, v in opt.state[p].items()} for p in params]
    assert shapes[0] == {"exp_avg_sq_row": (37,), "exp_avg_sq_col": (53,)}
    assert shapes[1] == {"exp_avg_sq": (101,)}
    assert shapes[3] == {"exp_avg_sq_row": (19,), "exp_avg_sq_col": (70,)}
    assert shapes[5] == {"exp_avg_sq_row": (3, 11), "exp_avg_sq_col": (3, 17)}


@pytest.mark.parametrize("kw, chunks", RUNS)
def test_same_bits_whatever_the_chunking_or_offload(kw, chunks):
    ref_params = _params()
    ref = Adafactor(ref_params, **HYPER)
    _steps(ref_params, ref, 0, STEPS)
    assert _chunks(ref) == 1
    params = _params()
    opt = Adafactor(params, **HYPER, **kw)
    _steps(params, opt, 0, STEPS)
    assert _chunks(opt) == chunks
    assert same_tensors(ref_params, params)
    assert same_state(state_copy(ref, ref_params), state_copy(opt, params))


def _loop64(steps: int):
    """The rule written out in float64, parameter by parameter (a stack matrix by matrix),
    each parameter with its own count."""
    xs = [p.detach().double() for p in _params()]
    state = [
        (torch.zeros(s[:-1]), torch.zeros(s[:-2] + s[-1:])) if len(s) >= 2 else (torch.zeros(s),)
        for s in SHAPES
    ]
    state = [tuple(t.double() for t in entry) for entry in state]
    counts = [0] * len(SHAPES)
    for s in range(steps):
        for i, x in enumerate(xs):
            if (s, i) in SKIPS:
                continue
            counts[i] += 1
            beta2 = 1.0 - counts[i] ** -DECAY
            g = _grad(s, i).double()
            g2 = g * g + EPS1
            if x.ndim >= 2:
                r = beta2 * state[i][0] + (1 - beta2) * g2.mean(dim=-1)
                c = beta2 * state[i][1] + (1 - beta2) * g2.mean(dim=-2)
                state[i] = (r, c)
                rows, cols = r.reshape(-1, x.shape[-2]), c.reshape(-1, x.shape[-1])
                v = torch.stack(
                    [torch.outer(a, b) / a.mean() for a, b in zip(rows, cols, strict=True)]
                )
                v = v.reshape(x.shape)
            else:
                v = beta2 * state[i][0] + (1 - beta2) * g2
                state[i] = (v,)
            u = g / v.sqrt()
            u = u / max(1.0, math.sqrt(float((u * u).mean())) / CLIP)
            xs[i] = x * (1 - HYPER["lr"] * HYPER["weight_decay"]) - HYPER["lr"] * u
    return xs, state


def test_equals_a_float64_loop_of_the_rule():
    """fp32 against float64. The weights: each step rounds them twice in fp32 (the decay's
    product, the update's difference), at most 2^-24 of |x| each, so 4 steps leave them within
    8 x 2^-24 x max|x| (1.7e-6 at the largest, 3.5); the update's own fp32 error (a few epsilons
    of lr |u|, ~1e-9) is below that. Measured: 8.1e-7 at most, while the rule moves them by up
    to 0.08 (a wrong rule is far outside). The statistics: fp32 means of at most 101 squares,
    a few fp32 epsilons (6e-8) relative a step; measured 2.1e-7 relative, allowed 1e-6."""
    params = _params()
    opt = Adafactor(params, **HYPER, offload=True, chunk_bytes=25_000)
    _steps(params, opt, 0, STEPS)
    xs, state = _loop64(STEPS)
    for p, x, entry in zip(params, xs, state, strict=True):
        atol = 2 * STEPS * 2**-24 * float(x.abs().max())
        torch.testing.assert_close(p.detach().double(), x, rtol=0, atol=atol)
        for ours, theirs in zip(opt.state[p].values(), entry, strict=True):
            torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=0)


def test_state_dict_round_trip():
    params = _params()
    opt = Adafactor(params, **HYPER, offload=True, chunk_bytes=25_000)
    _steps(params, opt, 0, 3)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["exp_avg_sq_row"].shape == (37,)
    assert [float(saved["state"][i]["step"]) for i in range(len(SHAPES))] == [3, 2, 3, 3, 3, 3]
    again_params = _params()
    again = Adafactor(again_params, **HYPER)  # resident, one chunk: another layout
    for p, q in zip(params, again_params, strict=True):
        q.data.copy_(p.data)
    again.load_state_dict(saved)
    assert same_state(state_copy(opt, params), state_copy(again, again_params))
    _steps(params, opt, 3, 1)
    _steps(again_params, again, 3, 1)
    assert same_tensors(params, again_params)
    assert same_state(state_copy(opt, params), state_copy(again, again_params))
    # A row vector of another length is refused before anything is written.
    bad = copy.deepcopy(saved)
    bad["state"][3]["exp_avg_sq_row"] = torch.zeros(70)
    before = state_copy(again, again_params)
    with pytest.raises(ValueError, match="exp_avg_sq_row"):
        again.load_state_dict(bad)
    assert same_state(before, state_copy(again, again_params))


def _sharded_refused(rank, world, port):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dist_workers

    mesh = dist_workers.init(rank, world, port)
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    sharded = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    with pytest.raises(NotImplementedError, match="no rule for a DTensor sharded across ranks"):
        Adafactor([sharded], distributed_mesh=mesh, **HYPER)
    replicated = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Replicate()]))
    Adafactor([replicated], distributed_mesh=mesh, **HYPER)
    dist_workers._finish()


@pytest.mark.distributed
def test_a_whole_parameter_plugin_refuses_a_sharded_dtensor():
    """Without a rule for shards (Muon has its collectives), row and column means of a shard
    would be a shard's: refused before any state exists, naming the parameter."""
    import _processes

    _processes.run(_sharded_refused, 2)
