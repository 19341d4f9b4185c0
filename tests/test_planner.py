"""The chunk planner: pure Python, checked on random workloads without any tensor."""

import random

import pytest

from muon_offload.engine.planner import (
    SEGMENT_ALIGN,
    ElementwiseUnit,
    MuonUnit,
    ParamInfo,
    plan_step,
)


def _random_params(rng, n=40, resident_share=0.0):
    params = []
    shapes = [(64, 32), (32, 64), (48, 48), (3, 16, 16)]
    for i in range(n):
        group = rng.randrange(3)
        algorithm = ["muon", "adamw", "lion"][group]
        if algorithm == "muon":
            shape = rng.choice(shapes)
            numel = 1
            for d in shape:
                numel *= d
            per = 4
            key = (shape, "f32")
        else:
            numel = rng.choice([1, 7, 100, 5000, 40000])
            per = 8 if algorithm == "adamw" else 4
            key = None
        params.append(
            ParamInfo(
                index=i,
                group=group,
                algorithm=algorithm,
                numel=numel,
                plan_bytes=numel * per,
                batch_key=key,
                resident=rng.random() < resident_share,
            )
        )
    return params


def _check_plan(params, plan, chunk_bytes, resident_chunk_bytes=None):
    by_index = {p.index: p for p in params}
    muon_seen = []
    covered = {p.index: [] for p in params if p.algorithm != "muon"}
    for chunk in plan.chunks:
        assert chunk.plan_bytes == sum(u.plan_bytes for u in chunk.units)
        budget = chunk_bytes
        if chunk.resident and resident_chunk_bytes is not None:
            budget = resident_chunk_bytes
        # Over budget only as a lone oversized muon unit, or by less than one aligned
        # element-wise cut when the budget is smaller than that. Only streamed parameters
        # are reported as oversized (they size the staging ring).
        if chunk.plan_bytes > max(budget, SEGMENT_ALIGN * 8):
            assert len(chunk.units) == 1 and isinstance(chunk.units[0], MuonUnit)
            assert len(chunk.units[0].params) == 1
            assert (chunk.units[0].params[0] in plan.oversized) == (not chunk.resident)
        for unit in chunk.units:
            if isinstance(unit, MuonUnit):
                members = [by_index[i] for i in unit.params]
                assert {m.group for m in members} == {unit.group}
                assert len({m.batch_key for m in members}) == 1
                assert {m.resident for m in members} == {chunk.resident}
                assert unit.plan_bytes == sum(m.plan_bytes for m in members)
                muon_seen.extend(unit.params)
            else:
                assert isinstance(unit, ElementwiseUnit)
                for seg in unit.segments:
                    assert by_index[seg.param].group == unit.group
                    assert by_index[seg.param].resident == chunk.resident
                    covered[seg.param].append((seg.start, seg.stop))
                    assert seg.start % SEGMENT_ALIGN == 0
    # Every muon parameter in exactly one unit: a packed parameter is updated once per step.
    assert sorted(muon_seen) == sorted(p.index for p in params if p.algorithm == "muon")
    # Element-wise parameters covered exactly, in order, without overlap.
    for index, ranges in covered.items():
        pos = 0
        for start, stop in ranges:
            assert start == pos and stop > start
            pos = stop
        assert pos == by_index[index].numel
    # Resident chunks first.
    flags = [c.resident for c in plan.chunks]
    assert flags == sorted(flags, reverse=True)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("chunk_bytes", [1, 100, 9000, 50_000, 10**9])
def test_random_plans_are_sound(seed, chunk_bytes):
    rng = random.Random(seed)
    params = _random_params(rng, resident_share=[0.0, 0.3, 1.0][seed % 3])
    plan = plan_step(params, chunk_bytes)
    _check_plan(params, plan, chunk_bytes)
    assert plan == plan_step(params, chunk_bytes)  # pure: same input, same plan


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budgets", [(1, 10**9), (9000, 100), (50_000, 50_000), (100, 9000)])
def test_resident_and_streamed_parts_take_their_own_budgets(seed, budgets):
    chunk_bytes, resident_chunk_bytes = budgets
    params = _random_params(random.Random(seed), resident_share=0.5)
    plan = plan_step(params, chunk_bytes, resident_chunk_bytes)
    _check_plan(params, plan, chunk_bytes, resident_chunk_bytes)
    # Each part is planned as if it were alone with its budget.
    for resident, budget in ((True, resident_chunk_bytes), (False, chunk_bytes)):
        part = [p for p in params if p.resident == resident]
        alone = plan_step(part, budget)
        assert [c for c in plan.chunks if c.resident == resident] == list(alone.chunks)


def test_large_embedding_is_split_so_no_chunk_goes_over_budget():
    emb = ParamInfo(0, 0, "adamw", numel=1_000_003, plan_bytes=8_000_024)
    plan = plan_step([emb], chunk_bytes=1 << 20)
    assert len(plan.chunks) == 8
    assert all(c.plan_bytes <= 1 << 20 for c in plan.chunks)
    _check_plan([emb], plan, 1 << 20)


@pytest.mark.parametrize("resident", [False, True])
def test_oversized_matrix_gets_its_own_chunk(resident):
    small = [ParamInfo(i, 0, "muon", 100, 400, ("s",), resident) for i in range(3)]
    big = ParamInfo(3, 0, "muon", 10_000, 40_000, ("b",), resident)
    plan = plan_step(small + [big], chunk_bytes=1000)
    # Reported only when streamed: a resident one sizes no staging buffer.
    assert plan.oversized == (() if resident else (3,))
    assert [u.params for c in plan.chunks for u in c.units] == [(0, 1), (2,), (3,)]


def test_units_batch_same_shape_up_to_the_budget():
    params = [ParamInfo(i, 0, "muon", 100, 400, ("a" if i % 2 else "b",)) for i in range(10)]
    plan = plan_step(params, chunk_bytes=1200)
    units = [u.params for u in plan.units()]
    assert units == [(0, 2, 4), (6, 8), (1, 3, 5), (7, 9)]


def test_one_unit_per_chunk_to_everything_in_one():
    rng = random.Random(11)
    params = _random_params(rng)
    everything = plan_step(params, 10**12)
    assert len(everything.chunks) == 1
    tiny = plan_step(params, 1)
    assert all(len(c.units) == 1 for c in tiny.chunks)


def test_rejects_nonpositive_budget():
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_step([], 0)
    with pytest.raises(ValueError, match="resident_chunk_bytes"):
        plan_step([], 10, 0)
