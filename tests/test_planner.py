"""The chunk planner: pure Python, checked on random workloads without any tensor."""

import dataclasses
import math
import random
from collections import Counter
from dataclasses import astuple

import pytest

from muon_offload.engine import planner
from muon_offload.engine.planner import (
    SEGMENT_ALIGN,
    ElementwiseUnit,
    MatrixUnit,
    ParamInfo,
    elementwise_only,
    holds_matrices,
    plan_step,
)


def _random_params(rng, n=40, resident_share=0.0):
    params = []
    shapes = [(64, 32), (32, 64), (48, 48), (3, 16, 16), (7, 9, 13), (2, 3, 8, 8)]
    for i in range(n):
        group = rng.randrange(3)
        algorithm = ["muon", "adamw", "lion"][group]
        matrices = 1
        if algorithm == "muon":
            shape = rng.choice(shapes)
            numel = math.prod(shape)
            per = 4
            key = (shape, "f32")
            matrices = math.prod(shape[:-2])
        else:
            # 13,000: over the largest cut budget (50,000 bytes) at 4 and 8 bytes an element,
            # so cut at every budget but 10**9; the planning time grows with the segments a
            # budget below one aligned cut makes (numel / 64), so no larger.
            numel = rng.choice([1, 7, 100, 5000, 13000])
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
                matrices=matrices,
                elementwise=algorithm != "muon",
            )
        )
    return params


def _matrix(index, numel, key, resident=True, group=0, algorithm="muon"):
    """A matrix parameter of fp32 state (4 bytes an element), as Muon's."""
    return ParamInfo(index, group, algorithm, numel, 4 * numel, key, resident, elementwise=False)


def _piece_bytes(p, piece):
    """A matrix item's share of its parameter's plan_bytes: matrices [start, stop) of
    ``p.matrices`` (the whole for None), rounded so that the pieces add up to the whole."""
    if piece is None:
        return p.plan_bytes
    return p.plan_bytes * piece.stop // p.matrices - p.plan_bytes * piece.start // p.matrices


def _first_matrix_bytes(p, piece):
    """The plan bytes of the first matrix of a matrix item: its whole where it cannot be cut."""
    if p.matrices <= 1:
        return p.plan_bytes
    first = 0 if piece is None else piece.start
    return p.plan_bytes * (first + 1) // p.matrices - p.plan_bytes * first // p.matrices


def _covers_exactly(ranges, end):
    """[start, stop) ranges that cover [0, end) once each, without gap or overlap."""
    pos = 0
    for start, stop in sorted(ranges):
        assert start == pos and stop > start
        pos = stop
    assert pos == end


def _check_plan(params, plan, chunk_bytes, resident_chunk_bytes=None):
    by_index = {p.index: p for p in params}
    matrix_seen = {p.index: [] for p in params if not p.elementwise}
    covered = {p.index: [] for p in params if p.elementwise}
    last_unit = {}  # per bucket (group, batch key, resident): its latest matrix unit
    for chunk in plan.chunks:
        assert chunk.plan_bytes == sum(u.plan_bytes for u in chunk.units)
        budget = chunk_bytes
        if chunk.resident and resident_chunk_bytes is not None:
            budget = resident_chunk_bytes
        # Over budget only as a lone unit of one piece that cannot be cut (a matrix, or a
        # parameter kept whole), or by less than one aligned element-wise cut when the budget
        # is smaller than that. Only streamed parameters are reported as oversized (they size
        # the staging arena).
        if chunk.plan_bytes > max(budget, SEGMENT_ALIGN * 8):
            assert len(chunk.units) == 1 and isinstance(chunk.units[0], MatrixUnit)
            unit = chunk.units[0]
            assert len(unit.params) == 1
            piece = unit.piece(0)
            assert by_index[unit.params[0]].matrices == 1 or piece.stop - piece.start == 1
            assert (unit.params[0] in plan.oversized) == (not chunk.resident)
        for unit in chunk.units:
            if isinstance(unit, MatrixUnit):
                members = [by_index[i] for i in unit.params]
                pieces = [unit.piece(k) for k in range(len(members))]
                assert unit.pieces == () or len(unit.pieces) == len(members)
                assert {m.group for m in members} == {unit.group}
                assert len({m.batch_key for m in members}) == 1
                assert {m.resident for m in members} == {chunk.resident}
                assert unit.plan_bytes == sum(map(_piece_bytes, members, pieces))
                assert {m.algorithm for m in members} == {unit.algorithm}
                for m, piece in zip(members, pieces, strict=True):
                    assert piece is None or m.matrices > 1  # only a stack is cut
                    whole = (0, m.matrices)
                    matrix_seen[m.index].append(whole if piece is None else astuple(piece))
                bucket = (unit.group, members[0].batch_key, chunk.resident)
                last = last_unit.get(bucket)
                # Units are full: the one before had no room for this one's first matrix.
                if last is not None:
                    assert last.plan_bytes + _first_matrix_bytes(members[0], pieces[0]) > budget
                last_unit[bucket] = unit
            else:
                assert isinstance(unit, ElementwiseUnit)
                for seg in unit.segments:
                    assert by_index[seg.param].group == unit.group
                    assert by_index[seg.param].resident == chunk.resident
                    covered[seg.param].append((seg.start, seg.stop))
                    assert seg.start % SEGMENT_ALIGN == 0
    # Every matrix of every matrix parameter in exactly one unit: a packed parameter, a
    # matrix, is updated once per step.
    for index, ranges in matrix_seen.items():
        _covers_exactly(ranges, by_index[index].matrices)
    # Element-wise parameters covered exactly, without overlap (the chunks holding a
    # parameter's segments need not run in the segments' order: ``interleave``).
    for index, ranges in covered.items():
        _covers_exactly(ranges, by_index[index].numel)
    # Resident chunks first.
    flags = [c.resident for c in plan.chunks]
    assert flags == sorted(flags, reverse=True)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("chunk_bytes", [1, 100, 1000, 9000, 50_000, 10**9])
def test_random_plans_are_sound(seed, chunk_bytes):
    rng = random.Random(seed)
    params = _random_params(rng, resident_share=[0.0, 0.3, 1.0][seed % 3])
    plan = _plan(params, chunk_bytes)
    _check_plan(params, plan, chunk_bytes)
    assert plan == _plan(params, chunk_bytes)  # pure: same input, same plan


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
        alone = _plan(part, budget)
        assert [c for c in plan.chunks if c.resident == resident] == list(alone.chunks)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budgets", [(9000, 1000), (50_000, 9000), (50_000, 50_000), (100, 1)])
def test_streamed_chunks_hold_at_most_the_elementwise_budget(seed, budgets):
    """A streamed chunk holds at most ``elementwise_chunk_bytes`` of element-wise state (by
    less than one aligned cut over it, as the chunk budget allows), and still within
    ``chunk_bytes``; resident chunks stage nothing and keep their budget; without the
    argument the plan is the one of ``elementwise_chunk_bytes == chunk_bytes``."""
    chunk_bytes, elementwise = budgets
    params = _random_params(random.Random(seed), resident_share=0.3)
    plan = plan_step(params, chunk_bytes, chunk_bytes, elementwise)
    _check_plan(params, plan, chunk_bytes)
    per_elem = {p.index: -(-p.plan_bytes // max(p.numel, 1)) for p in params}
    for chunk in plan.chunks:
        units = [u for u in chunk.units if isinstance(u, ElementwiseUnit)]
        held = sum(u.plan_bytes for u in units)
        if not chunk.resident and held:
            largest_cut = max(per_elem[s.param] for u in units for s in u.segments)
            assert held <= max(elementwise, SEGMENT_ALIGN * largest_cut)
    resident = [c for c in plan.chunks if c.resident]
    assert resident == [c for c in _plan(params, chunk_bytes).chunks if c.resident]
    assert _plan(params, chunk_bytes) == plan_step(params, chunk_bytes, chunk_bytes, chunk_bytes)


def test_a_large_adamw_parameter_streams_in_elementwise_sized_chunks():
    """A Muon stack of 1 GiB-budget size beside an AdamW embedding: the matrix chunk keeps
    its budget, the embedding's state streams in chunks of the element-wise budget."""
    stack = _stack(0, (8, 64, 64))  # 131,072 bytes of fp32-width state
    emb = ParamInfo(1, 1, "adamw", 100_000, 200_000, resident=False, elementwise=True)
    plan = plan_step([stack, emb], 131_072, 131_072, 32_768)
    _check_plan([stack, emb], plan, 131_072)
    sizes = [c.plan_bytes for c in plan.chunks]
    assert sizes[0] == 131_072 and holds_matrices(plan.chunks[0])
    assert all(n <= 32_768 for n in sizes[1:]) and sum(sizes[1:]) == 200_000
    assert len(plan_step([stack, emb], 131_072, 131_072).chunks) == 3  # 131,072 + 68,928


def test_large_embedding_is_split_so_no_chunk_goes_over_budget():
    emb = ParamInfo(0, 0, "adamw", numel=1_000_003, plan_bytes=8_000_024, elementwise=True)
    plan = _plan([emb], 1 << 20)
    assert len(plan.chunks) == 8
    assert all(c.plan_bytes <= 1 << 20 for c in plan.chunks)
    _check_plan([emb], plan, 1 << 20)


@pytest.mark.parametrize("resident", [False, True])
def test_oversized_matrix_gets_its_own_chunk(resident):
    small = [_matrix(i, 100, ("s",), resident) for i in range(3)]
    big = _matrix(3, 10_000, ("b",), resident)
    plan = _plan(small + [big], 1000)
    # Reported only when streamed: a resident one sizes no staging buffer.
    assert plan.oversized == (() if resident else (3,))
    assert [u.params for c in plan.chunks for u in c.units] == [(0, 1), (2,), (3,)]


def _stack(index, shape, resident=False, group=0):
    """A Muon stack of fp32 state: ``shape[:-2]`` matrices that the planner may cut between."""
    numel = math.prod(shape)
    return ParamInfo(
        index,
        group,
        "muon",
        numel,
        4 * numel,
        (shape,),
        resident,
        matrices=math.prod(shape[:-2]),
        elementwise=False,
    )


def test_moe_stacks_are_cut_at_matrix_boundaries_to_fill_their_units():
    """Two layers of 48 experts of 1024 x 1024 (192 MiB of fp32 momentum each) against
    128 MiB chunks: units of 32 matrices, the second holding the first stack's last 16 and
    the second's first 16, each within budget (no 192 MiB chunk whose load nothing overlaps),
    three batches where pieces of whole-stack units took four; nothing is oversized."""
    stacks = [_stack(0, (48, 1024, 1024)), _stack(1, (48, 1024, 1024))]
    plan = _plan(stacks, 128 << 20)
    _check_plan(stacks, plan, 128 << 20)
    units = [(u.params, [astuple(p) for p in u.pieces]) for u in plan.units()]
    assert units == [((0,), [(0, 32)]), ((0, 1), [(32, 48), (0, 16)]), ((1,), [(16, 48)])]
    assert [c.plan_bytes for c in plan.chunks] == [128 << 20] * 3 and plan.oversized == ()


def test_stack_that_fits_a_fresh_unit_is_cut_to_fill_the_one_before():
    """Resident budgets of 512 MiB and the MoE expert stacks (192 MiB each): 2.67 stacks a
    unit, 6 units for 16 stacks (8 when each stack stayed whole)."""
    stacks = [_stack(i, (48, 1024, 1024), resident=True) for i in range(16)]
    plan = _plan(stacks, 512 << 20)
    _check_plan(stacks, plan, 512 << 20)
    assert len(plan.units()) == 6
    assert [u.plan_bytes for u in plan.units()] == [512 << 20] * 6


@pytest.mark.parametrize("resident", [False, True])
@pytest.mark.parametrize("chunk_bytes", [1, 8_000, 8_580, 20_000, 40_000, 60_059, 60_060])
def test_stack_and_vector_below_budget_are_covered_once_within_it(resident, chunk_bytes):
    """A (7, 33, 65) stack (8,580 bytes a matrix), a 2-D matrix (9,100 bytes), and an AdamW
    vector, all over most of these budgets: no chunk goes over budget except one holding a
    single matrix alone, and every matrix and element is in exactly one unit."""
    params = [
        _stack(0, (7, 33, 65), resident),
        _stack(1, (35, 65), resident),
        _stack(2, (5, 33, 65), resident),
        ParamInfo(3, 1, "adamw", 10_007, 80_056, resident=resident, elementwise=True),
    ]
    plan = _plan(params, chunk_bytes)
    _check_plan(params, plan, chunk_bytes)
    assert plan == _plan(params, chunk_bytes)  # pure: shapes and budget alone decide
    # Over budget: the 2-D matrix below 9,100 bytes, and below 8,580 each of the 12 matrices.
    over = [c for c in plan.chunks if holds_matrices(c) and c.plan_bytes > chunk_bytes]
    assert len(over) == (0 if chunk_bytes >= 9_100 else 1 if chunk_bytes >= 8_580 else 13)


def test_stack_that_fits_is_not_cut():
    """Within budget a stack stays whole and batches with its shape's others."""
    params = [_stack(0, (7, 33, 65)), _stack(1, (7, 33, 65))]
    plan = _plan(params, 2 * 7 * 8580)
    assert [(u.params, u.pieces) for u in plan.units()] == [((0, 1), ())]


def test_units_batch_same_shape_up_to_the_budget():
    params = [_matrix(i, 100, ("a" if i % 2 else "b",)) for i in range(10)]
    plan = _plan(params, 1200)
    units = [u.params for u in plan.units()]
    assert units == [(0, 2, 4), (6, 8), (1, 3, 5), (7, 9)]


def test_one_unit_per_chunk_to_everything_in_one():
    """A budget over the step: one chunk, resident; streamed, one of each kind (the matrix
    units' and the element-wise ones')."""
    rng = random.Random(11)
    params = _random_params(rng)
    everything = _plan(params, 10**12)
    assert [holds_matrices(c) for c in everything.chunks] == [True, False]
    resident = [dataclasses.replace(p, resident=True) for p in params]
    assert len(_plan(resident, 10**12).chunks) == 1
    tiny = _plan(params, 1)
    assert all(len(c.units) == 1 for c in tiny.chunks)


def _plan(params, budget: int):
    """The plan with one budget for resident and streamed chunks alike."""
    return plan_step(params, budget, budget)


def _packed(monkeypatch, *args):
    """The plan with its chunks in packing order (``interleave`` left out)."""
    with monkeypatch.context() as m:
        m.setattr(planner, "interleave", lambda chunks: chunks)
        return plan_step(*args)


def _matrix_bytes(chunk):
    return sum(u.plan_bytes for u in chunk.units if isinstance(u, MatrixUnit))


def _check_interleaved(plan, packed):
    """``plan`` runs ``packed``'s chunks: resident ones first and unchanged, matrix-holding and
    element-wise-only ones each in their packed order, the element-wise ones spread so that
    after each matrix chunk the element-wise bytes issued are within half the largest
    element-wise chunk of their share (``interleave``'s rule)."""
    assert Counter(plan.chunks) == Counter(packed.chunks)  # the packing is unchanged
    assert plan.oversized == packed.oversized
    n_resident = sum(c.resident for c in packed.chunks)
    assert plan.chunks[:n_resident] == packed.chunks[:n_resident]
    streamed, packed_streamed = plan.chunks[n_resident:], packed.chunks[n_resident:]
    assert all(not c.resident for c in streamed)
    matrix = [c for c in streamed if holds_matrices(c)]
    others = [c for c in streamed if not holds_matrices(c)]
    assert matrix == [c for c in packed_streamed if holds_matrices(c)]
    assert others == [c for c in packed_streamed if not holds_matrices(c)]
    if not matrix or not others:
        assert streamed == packed_streamed
        return
    assert holds_matrices(streamed[0])  # nothing to hide an element-wise load before the first
    m_total = sum(max(1, _matrix_bytes(c)) for c in matrix)
    e_total = sum(max(1, c.plan_bytes) for c in others)
    e_max = max(max(1, c.plan_bytes) for c in others)
    m_done = e_done = 0
    for k, chunk in enumerate(streamed):
        if holds_matrices(chunk):
            m_done += max(1, _matrix_bytes(chunk))
        else:
            e_done += max(1, chunk.plan_bytes)
        if k + 1 == len(streamed) or holds_matrices(streamed[k + 1]):
            # |e_done / e_total - m_done / m_total| <= e_max / 2 / e_total
            assert abs(2 * e_done * m_total - 2 * m_done * e_total) <= e_max * m_total


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("chunk_bytes", [1, 100, 9000, 50_000, 10**9])
def test_streamed_chunks_interleave_elementwise_among_matrix_chunks(seed, chunk_bytes, monkeypatch):
    rng = random.Random(seed)
    params = _random_params(rng, n=rng.choice([5, 40, 120]), resident_share=[0.0, 0.3][seed % 2])
    plan = plan_step(params, chunk_bytes, 20_000)
    _check_plan(params, plan, chunk_bytes, 20_000)
    _check_interleaved(plan, _packed(monkeypatch, params, chunk_bytes, 20_000))


def test_interleave_leaves_one_kind_alone(monkeypatch):
    muon = [_matrix(i, 100, ("a",), resident=False) for i in range(6)]
    adamw = [
        ParamInfo(6 + i, 1, "adamw", 100, 800, resident=False, elementwise=True) for i in range(6)
    ]
    for params in (muon, adamw):
        plan = _plan(params, 1000)
        assert len(plan.chunks) > 2
        assert plan == _packed(monkeypatch, params, 1000, 1000)


def _workload_infos(specs):
    """ParamInfos as the optimizer makes them for fp32 state: Muon's momentum 4 bytes an
    element, AdamW's two moments 8; every parameter streamed."""
    infos = []
    for i, s in enumerate(specs):
        muon = s.algorithm == "muon"
        infos.append(
            ParamInfo(
                index=i,
                group=0 if muon else 1,
                algorithm=s.algorithm,
                numel=s.numel,
                plan_bytes=s.numel * (4 if muon else 8),
                batch_key=(s.shape, "f32") if muon else None,
                resident=False,
                elementwise=not muon,
            )
        )
    return infos


@pytest.mark.parametrize("layers", [8, 32])
def test_llama3_adamw_chunks_run_among_muon_ones_not_as_a_tail(layers, monkeypatch):
    """llama3-8b-fsdp8-rank at the default 128 MiB: ~1 GB of AdamW state (embedding and
    lm_head shards) once ran as a tail of pure-transfer chunks after every Muon chunk
    (0.137 s offloaded against 0.116 s resident on the H200). Now no more than ceil(E / M) + 1
    element-wise chunks run in a row (E of them, M Muon-holding chunks)."""
    from muon_offload.tools.workloads import llama3_8b_fsdp8_rank

    infos = _workload_infos(llama3_8b_fsdp8_rank(layers))
    plan = _plan(infos, 128 << 20)
    kinds = "".join("M" if holds_matrices(c) else "e" for c in plan.chunks)
    n_muon, n_elementwise = kinds.count("M"), kinds.count("e")
    assert n_muon >= 5 and n_elementwise >= 7, kinds
    longest = max(len(run) for run in kinds.split("M"))
    assert longest <= -(-n_elementwise // n_muon) + 1, kinds
    assert kinds.rstrip("e").count("e") >= n_elementwise // 2, kinds  # not mostly a tail
    _check_interleaved(plan, _packed(monkeypatch, infos, 128 << 20, 128 << 20))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("chunk_bytes", [1, 100, 9000, 50_000, 10**9])
def test_elementwise_only_marks_the_chunks_without_matrix_units(seed, chunk_bytes):
    """One flag a chunk, in run order (resident chunks too): True exactly when the chunk
    holds no matrix unit; a chunk with matrix units and element-wise ones is not marked."""
    rng = random.Random(seed)
    params = _random_params(rng, n=rng.choice([5, 40, 120]), resident_share=[0.0, 0.3][seed % 2])
    plan = plan_step(params, chunk_bytes, 20_000)
    flags = elementwise_only(plan)
    assert len(flags) == len(plan.chunks)
    for chunk, flag in zip(plan.chunks, flags, strict=True):
        assert flag == all(isinstance(u, ElementwiseUnit) for u in chunk.units)
    mixed = [c for c in plan.chunks if holds_matrices(c) and len({type(u) for u in c.units}) == 2]
    assert all(not flags[plan.chunks.index(c)] for c in mixed)


@pytest.mark.parametrize("seed", range(8))
def test_unmarked_chunks_hold_the_same_matrix_units_in_order_on_every_rank(seed):
    """Ranks whose element-wise shards differ in size (their chunks are cut on local sizes)
    have the same matrix units, in the same order, in the chunks ``elementwise_only`` leaves
    unmarked: those that the scheduler runs in plan order on the compute stream, where their
    collectives are issued."""
    rng = random.Random(seed)
    params = _random_params(rng, n=80)
    ranks = [params]
    for _ in range(2):
        other = []
        for p in params:
            if p.elementwise:
                numel = max(1, p.numel + rng.randrange(-p.numel // 2, p.numel))
                p = dataclasses.replace(
                    p, numel=numel, plan_bytes=numel * (p.plan_bytes // p.numel)
                )
            other.append(p)
        ranks.append(other)
    lanes = []
    for infos in ranks:
        plan = _plan(infos, 9000)
        flags = elementwise_only(plan)
        lanes.append(
            [
                [u for u in c.units if isinstance(u, MatrixUnit)]
                for c, flag in zip(plan.chunks, flags, strict=True)
                if not flag
            ]
        )
        assert sum(flags) > 0
    assert lanes[0] == lanes[1] == lanes[2] and lanes[0]


def _renamed(infos_or_plan, old, new):
    """ParamInfos, or a plan's units, with algorithm ``old`` named ``new`` (all else kept)."""

    def rename(x):
        return dataclasses.replace(x, algorithm=new) if x.algorithm == old else x

    if isinstance(infos_or_plan, list):
        return [rename(p) for p in infos_or_plan]
    chunks = tuple(
        dataclasses.replace(c, units=tuple(map(rename, c.units))) for c in infos_or_plan.chunks
    )
    return dataclasses.replace(infos_or_plan, chunks=chunks)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chunk_bytes", [100, 9000, 10**9])
def test_a_matrix_algorithm_of_any_name_batches_as_muon_does(seed, chunk_bytes):
    """The planner asks ``ParamInfo.elementwise``, not the name: a made-up non-element-wise
    algorithm is planned exactly as Muon is, its units carry its name, and beside Muon (in a
    group of its own) each group's units carry their own algorithm."""
    params = _random_params(random.Random(seed), n=60, resident_share=0.3)
    muon_plan = plan_step(params, chunk_bytes, 20_000)
    renamed = _renamed(params, "muon", "shampoo-like")
    plan = plan_step(renamed, chunk_bytes, 20_000)
    _check_plan(renamed, plan, chunk_bytes, 20_000)
    assert plan == _renamed(muon_plan, "muon", "shampoo-like")
    matrix_units = [u for u in plan.units() if isinstance(u, MatrixUnit)]
    assert matrix_units and {u.algorithm for u in matrix_units} == {"shampoo-like"}
    # Muon in group 0, the made-up one in group 1 (element-wise groups 1 and 2 become 2 and 3).
    both = [dataclasses.replace(p, group=p.group + (p.group > 0 or p.index % 2)) for p in params]
    both = [dataclasses.replace(p, algorithm="shampoo-like") if p.group == 1 else p for p in both]
    plan = plan_step(both, chunk_bytes, 20_000)
    _check_plan(both, plan, chunk_bytes, 20_000)
    names = {u.group: u.algorithm for u in plan.units() if isinstance(u, MatrixUnit)}
    assert names == {0: "muon", 1: "shampoo-like"}


@pytest.mark.parametrize("seed", range(4))
def test_the_name_muon_makes_no_matrix_unit(seed):
    """A parameter whose algorithm is element-wise is cut into segments whatever its name:
    named "muon", it is planned exactly as under any other element-wise name."""
    params = _random_params(random.Random(seed), n=60)
    flat = [dataclasses.replace(p, elementwise=True, batch_key=None) for p in params]
    plan = _plan(flat, 9000)
    _check_plan(flat, plan, 9000)
    assert not any(isinstance(u, MatrixUnit) for u in plan.units())
    assert _renamed(plan, "muon", "other") == _plan(_renamed(flat, "muon", "other"), 9000)


def test_param_info_says_whether_it_is_elementwise():
    """No default: a caller that forgets the flag is told, not given one kind silently."""
    with pytest.raises(TypeError, match="elementwise"):
        ParamInfo(0, 0, "adamw", 10, 80)
