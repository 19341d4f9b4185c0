"""The ends of a streamed step (engine/taper.py): the matrix chunks at both ends halved at
matrix boundaries, pure Python; a step whose plan is tapered equals the resident step bit for
bit (the CPU's torch path and the Triton kernels, interpreted)."""

import dataclasses
import random

import pytest
import torch
from _mixed_runs import assert_bitwise, mixed_run

from muon_offload import Muon
from muon_offload.engine import taper as taper_module
from muon_offload.engine.planner import MatrixUnit, ParamInfo, holds_matrices, plan_step
from muon_offload.engine.taper import TAPER_FLOOR, taper

MIB = 1 << 20


def _matrices(n: int, mib: int = 4, stack: int = 1, start: int = 0, key="m") -> list[ParamInfo]:
    """``n`` Muon parameters of ``stack`` matrices of ``mib`` MiB each (fp32 width)."""
    return [
        ParamInfo(start + i, 0, "muon", mib * MIB // 4 * stack, mib * MIB * stack, (key, stack),
                  resident=False, matrices=stack, elementwise=False)
        for i in range(n)
    ]  # fmt: skip


def _adamw(index: int, numel: int, resident: bool = False) -> ParamInfo:
    return ParamInfo(index, 1, "adamw", numel, 8 * numel, resident=resident, elementwise=True)


def _items(plan, streamed_only=True) -> list[tuple[int, int]]:
    """(parameter, matrix) of every matrix unit, in run order."""
    out = []
    for chunk in plan.chunks:
        if streamed_only and chunk.resident:
            continue
        for unit in chunk.units:
            if not isinstance(unit, MatrixUnit):
                continue
            for k, index in enumerate(unit.params):
                piece = unit.piece(k)
                count = piece.stop - piece.start if piece else None
                out += [(index, piece.start + j) for j in range(count)] if piece else [(index, -1)]
    return out


def _whole(items, params):
    """``_items`` with each whole parameter's marker expanded into its matrices."""
    by_index = {p.index: p for p in params}
    out = []
    for index, j in items:
        out += [(index, m) for m in range(by_index[index].matrices)] if j < 0 else [(index, j)]
    return out


def _sizes(plan) -> list[int]:
    return [c.plan_bytes // MIB for c in plan.chunks if holds_matrices(c)]


def test_full_chunks_halve_to_an_eighth_at_each_end():
    """256 matrices of 4 MiB in 128 MiB chunks: eight full chunks, tapered to 16, 16, 32, 64
    at the start and 64, 32, 16, 16 at the end; every matrix once, in the same order."""
    params = _matrices(256)
    plan = plan_step(params, 128 * MIB, 512 * MIB)
    assert _sizes(plan) == [128] * 8
    tapered = taper(plan, params, 128 * MIB)
    assert _sizes(tapered) == [16, 16, 32, 64, 128, 128, 128, 128, 128, 128, 64, 32, 16, 16]
    assert _whole(_items(tapered), params) == _whole(_items(plan), params)


def test_stacks_are_cut_between_their_matrices_and_a_small_last_chunk_counts():
    """The MoE case: stacks of 48 matrices of 4 MiB (192 MiB, more than a chunk) and a small
    bucket last (3 MiB): the chunk before that one is halved down to the floor, not to single
    matrices; pieces of a stack stay whole matrices, each once."""
    params = _matrices(6, stack=48) + _matrices(1, mib=3, start=6, key="small")
    plan = plan_step(params, 128 * MIB, 512 * MIB)
    tapered = taper(plan, params, 128 * MIB)
    sizes = _sizes(tapered)
    assert sizes[:4] == [16, 16, 32, 64] and sizes[-6:] == [128, 64, 32, 16, 16, 3], sizes
    assert _whole(_items(tapered), params) == _whole(_items(plan), params)
    assert any(u.pieces for c in tapered.chunks for u in c.units)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget_mib", [33, 64, 128, 512])
def test_random_steps_keep_every_matrix_once_and_follow_the_rule(seed, budget_mib):
    """Random buckets of matrices and stacks, element-wise parameters and resident ones: the
    tapered plan holds the same matrices in the same order, the resident and element-wise
    chunks as they were, and from each end every matrix chunk is under twice what lies beyond
    it (or the floor), unless it cannot be halved (one matrix)."""
    rng = random.Random(seed)
    params, index = [], 0
    for b in range(rng.randrange(1, 5)):
        n, mib, stack = rng.randrange(1, 40), rng.choice([1, 3, 4, 9]), rng.choice([1, 1, 8, 48])
        params += _matrices(n, mib, stack, start=index, key=b)
        index += n
    for _ in range(rng.randrange(0, 3)):
        params.append(_adamw(index, rng.randrange(1, 30) * MIB // 8))
        index += 1
    params = [dataclasses.replace(p, resident=rng.random() < 0.2) for p in params]
    budget = budget_mib * MIB
    plan = plan_step(params, budget, 512 * MIB)
    tapered = taper(plan, params, budget)
    assert _whole(_items(tapered), params) == _whole(_items(plan), params)
    assert [c for c in tapered.chunks if c.resident] == [c for c in plan.chunks if c.resident]
    others = [c for c in plan.chunks if not c.resident and not holds_matrices(c)]
    assert [c for c in tapered.chunks if not c.resident and not holds_matrices(c)] == others
    floor = max(TAPER_FLOOR, budget >> 3)
    matrix = [c for c in tapered.chunks if not c.resident and holds_matrices(c)]
    for chunks in (matrix[::-1], matrix):
        beyond = 0
        for chunk in chunks:
            if beyond >= budget:
                break
            single = len(_whole(_items(dataclasses.replace(tapered, chunks=(chunk,))), params))
            assert chunk.plan_bytes < 2 * max(beyond, floor) or single == 1
            beyond += chunk.plan_bytes


def test_budgets_of_twice_the_floor_or_less_are_left_as_packed():
    params = _matrices(64, mib=1)
    for budget in (1, 4096, 2 * TAPER_FLOOR - 1):
        plan = plan_step(params, budget, budget)
        assert taper(plan, params, budget) is plan


def test_streamed_chunks_hold_one_kind_and_element_wise_ones_run_among_the_matrix_ones():
    """The element-wise state no longer fills the last matrix chunk's room (its transfers,
    long against its update, ended the step): it goes in chunks of its own, spread among
    the matrix chunks, none after the last one."""
    params = _matrices(40) + [_adamw(40, 20 * MIB), _adamw(41, 2 * MIB)]
    plan = taper(plan_step(params, 128 * MIB, 512 * MIB), params, 128 * MIB)
    kinds = [holds_matrices(c) for c in plan.chunks]
    assert all(len({isinstance(u, MatrixUnit) for u in c.units}) == 1 for c in plan.chunks)
    assert kinds[0] and kinds[-1] and not all(kinds), kinds


# Wide matrices and stacks of them, AdamW and Lion: the runs of tests/test_split_stacks.py.
SHAPES = [(7, 33, 65), (2, 3, 9, 10), (33, 65), (4099,), (70, 90), (300,)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_tapered_step_equals_the_resident_step_bitwise(monkeypatch, backend):
    """With the floor lowered to the CPU tests' sizes: the stack's pieces are cut again at
    the ends, and two steps equal the resident, unchunked ones bit for bit."""
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    resident = mixed_run(init, 3, 2, 40, steps=2, backend=backend)
    monkeypatch.setattr(taper_module, "TAPER_FLOOR", 1)
    cut = mixed_run(init, 3, 2, 40, steps=2, backend=backend, offload=True, chunk_bytes=40_000)
    plan = cut[1]._plans.last[1][0]
    assert len(_sizes(plan)) > 3, plan
    assert_bitwise(cut, resident)


@pytest.mark.cuda
@pytest.mark.parametrize("state_dtype", [None, torch.int8])
def test_a_tapered_step_equals_the_resident_step_bitwise_on_the_gpu(state_dtype):
    """At sizes the floor tapers (40 MiB chunks of 2 MiB matrices, the first halved to 20 MiB;
    the last two, 16 MiB each, stay), the Triton kernels, CUDA graphs and streams: three steps
    of fresh gradients equal the resident ones bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    init = [torch.randn(512, 1024, generator=gen, device="cuda") for _ in range(48)]
    init += [torch.randn(8, 512, 1024, generator=gen, device="cuda"), torch.randn(4099).cuda()]
    runs = []
    for kwargs in ({}, dict(offload=True, chunk_bytes=40 << 20)):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        groups = [dict(params=params[:-1]), dict(params=params[-1:], algorithm="adamw")]
        opt = Muon(groups, lr=0.02, weight_decay=0.05, state_dtype=state_dtype, **kwargs)
        for s in range(3):
            g = torch.Generator(device="cuda").manual_seed(100 + s)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g, device="cuda")
            opt.step()
            opt.zero_grad()
        runs.append((params, opt))
    plan = runs[1][1]._plans.last[1][0]
    assert [c.plan_bytes >> 20 for c in plan.chunks if holds_matrices(c)] == [20, 20, 40, 16, 16]
    assert_bitwise(runs[1], runs[0])


def test_steps_never_captured_keep_their_plan_and_others_taper(monkeypatch):
    """``cuda_graph=False`` Muon steps are bound by their host's launches: their plan keeps
    its ends (more batches would cost launches there); ``"auto"`` tapers; AdamW alone has no
    matrix chunk to taper (its setting says so all the same)."""
    from muon_offload import AdamW

    gen = torch.Generator().manual_seed(4)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    monkeypatch.setattr(taper_module, "TAPER_FLOOR", 1)
    _, opt = mixed_run(init, 3, 2, 40, steps=1, offload=True, chunk_bytes=40_000)
    tapered = _sizes(opt._plans.last[1][0])
    eager = mixed_run(init, 3, 2, 40, steps=1, offload=True, chunk_bytes=40_000, cuda_graph=False)
    assert not eager[1]._settings.now.tapers and opt._settings.now.tapers
    assert len(_sizes(eager[1]._plans.last[1][0])) < len(tapered)
    assert AdamW([torch.nn.Parameter(torch.ones(3))], cuda_graph=False)._settings.now.tapers
