"""``prefetch_bytes``: the staging arena holds that much (or the step's ring of three of its
largest chunks, if more), so the loads queued ahead of a step (``prefetch()``, the backward
hook) cover that much of its state, and as much of its last stores is left behind it (the
chunks no later load waits for). Through the CPU path: the arena's size, the chunks loaded
ahead and the results, which do not depend on it, bit for bit."""

import pytest
import torch
from _mixed_runs import assert_bitwise
from test_scheduler import _chunks, _Cuda

from muon_offload import AdamW, Muon
from muon_offload.engine.graph_ends import tail_of
from muon_offload.engine.scheduler import ARENA_ALIGN, align_up
from muon_offload.engine.settings import Settings

SHAPES = [(24, 40), (24, 40), (40, 24), (3, 8, 12), (16, 16), (77,), (300,), (5,), (1031,)]
CHUNK = 3000


def _loop(steps=3, seed=0, assign=None, **kwargs):
    """``steps`` steps of Muon (matrices) and AdamW, ``prefetch()`` before each; ``assign``:
    settings assigned after the first step."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    groups = [dict(params=params[:5]), dict(params=params[5:], algorithm="adamw")]
    opt = Muon(groups, lr=0.02, weight_decay=0.05, backend="torch", **kwargs)
    for s in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.prefetch()
        opt.step()
        if s == 0 and assign:
            for name, value in assign.items():
                setattr(opt, name, value)
    return params, opt


def _arena(opt):
    """(the arena's bytes, its ring's, the streamed chunks end to end, their sizes)."""
    sched = opt._streams.scheduler
    sizes = sched._sizes
    ring = 3 * align_up(max(sizes), ARENA_ALIGN)
    return sched.staging_bytes, ring, sum(align_up(n, ARENA_ALIGN) for n in sizes), sizes


@pytest.mark.parametrize("state_dtype", [None, torch.int8])
def test_the_arena_and_the_loads_ahead_follow_prefetch_bytes_and_the_bits_do_not(state_dtype):
    kw = dict(offload=True, chunk_bytes=CHUNK, state_dtype=state_dtype)
    resident = _loop(state_dtype=state_dtype)
    ring_only = _loop(prefetch_bytes=0, **kw)
    staging, ring, end_to_end, sizes = _arena(ring_only[1])
    assert staging == ring < end_to_end  # the ring alone; the step wraps it
    assert_bitwise(ring_only, resident)
    for prefetch_bytes in (ring + 5000, None, 1 << 40):
        run = _loop(prefetch_bytes=prefetch_bytes, **kw)
        # Its own sizes: a run lands in staging at its host address's residue (transfer.py).
        staging, ring, end_to_end, sizes = _arena(run[1])
        # The default (None) for Muon: three fifths, a third in 8-bit.
        num, den = (1, 3) if state_dtype == torch.int8 else (3, 5)
        want = (
            end_to_end * num // den if prefetch_bytes is None else min(prefetch_bytes, end_to_end)
        )
        assert staging == max(ring, align_up(want, ARENA_ALIGN)), prefetch_bytes
        sched = run[1]._streams.scheduler
        run[1].prefetch()  # the next step's loads: the chunks laid before the arena wraps
        ahead = sched.ahead.loads
        end = sched.layout.offsets[ahead - 1] + sizes[ahead - 1]  # of the last loaded ahead
        assert end <= staging
        if ahead < len(sizes):  # the next one did not fit
            assert align_up(end, ARENA_ALIGN) + sizes[ahead] > staging
        else:  # the whole step ahead, and every store behind it
            assert len(tail_of(sched.layout)) == len(sizes)
        assert (ahead == len(sizes)) == (prefetch_bytes == 1 << 40)
        assert_bitwise(run, resident)


def test_an_assigned_prefetch_bytes_sizes_a_new_arena():
    """Assigned between steps, larger or smaller: the next step stages in an arena of the new
    size (a smaller one given back), with the same bits as a run that never changed it."""
    kw = dict(offload=True, chunk_bytes=CHUNK)
    twin = _loop(prefetch_bytes=0, **kw)
    for first, then in ((1 << 40, 0), (0, 1 << 40)):
        run = _loop(prefetch_bytes=first, assign=dict(prefetch_bytes=then), **kw)
        staging, ring, end_to_end, _ = _arena(run[1])
        assert run[1].prefetch_bytes == then
        assert staging == (ring if then == 0 else end_to_end)
        assert_bitwise(run, twin)


def test_prefetch_bytes_is_checked_before_anything_changes():
    p = torch.nn.Parameter(torch.randn(4, 4))
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="prefetch_bytes must be an int >= 0 or None"):
            Muon([p], offload=True, prefetch_bytes=bad)
    opt = AdamW([p], offload=True, prefetch_bytes=1 << 20)
    with pytest.raises(ValueError, match="prefetch_bytes"):
        opt.prefetch_bytes = -1
    assert opt.prefetch_bytes == 1 << 20


@pytest.mark.parametrize("state_dtype", [None, torch.float32, torch.bfloat16, torch.int8])
def test_the_default_is_3_5_of_muon_state_a_third_in_8_bit_at_most_3_gib_else_none(
    state_dtype,
):
    muon = Settings.check(offload=True, state_dtype=state_dtype, batches_matrices=True)
    assert muon.prefetch_bytes is None
    int8 = state_dtype == torch.int8
    assert muon.staging_for(15 << 20) == (5 << 20 if int8 else 9 << 20)
    assert muon.staging_for(30 << 30) == 3 << 30
    # AdamW alone (no batches of matrices): the ring
    assert Settings.check(offload=True, state_dtype=state_dtype).staging_for(3 << 20) == 0
    given = Settings.check(offload=True, prefetch_bytes=5 << 20)
    assert given.staging_for(3 << 20) == 3 << 20  # never more than the step streams
    assert given.staging_for(30 << 30) == 5 << 20


def _critical_path(monkeypatch, staging, ahead: bool, transfers):
    """The step's time on test_scheduler's stand-in streams when each load and store takes its
    bytes (one link each way) and each update a fifth of them (a link-bound step, as fp32
    state's): the longest path of the dependency graph the scheduler queues, with the next
    step's first loads queued ahead (``prefetch.issue``: done before the step) or not.
    Returns (that time, the bytes loaded ahead, the largest chunk's)."""
    from muon_offload.engine import prefetch

    cuda = _Cuda(monkeypatch)
    sched = cuda.scheduler(staging=staging)
    sched.run(transfers, lambda i, views: cuda.current._add())
    if ahead:
        prefetch.issue(sched, transfers, None)
    start, marks = len(cuda.log), []
    sched.timeline = marks
    sched.run(transfers, lambda i, views: cuda.current._add())
    cost = {}
    for c, stage, _, end in marks:
        cost[end.node.index] = transfers[c].nbytes * (0.2 if stage == "update" else 1.0)
    done = {}
    for node in cuda.log:  # in queued order: every dependency first
        before = max((done[d.index] for d in node.deps), default=0.0)
        done[node.index] = 0.0 if node.index < start else before + cost.get(node.index, 0.0)
    updated = max(done[end.node.index] for _, stage, _, end in marks if stage == "update")
    n = prefetch.first_loads(sched.layout) if ahead else 0
    return updated, sum(t.nbytes for t in transfers[:n]), max(t.nbytes for t in transfers)


@pytest.mark.parametrize("chunks_ahead", [8, 16])
def test_loads_ahead_come_off_the_steps_critical_path(monkeypatch, chunks_ahead):
    """What the arena holds beyond its ring (``chunks_ahead`` of the 32 chunks' bytes) is
    loaded under backward and taken off the step: with the loads ahead, the longest path of
    the step's dependency graph is shorter than without them by their transfer time, less two
    chunks' (the step's first loads wait for the stores of the chunks loaded ahead, whose bytes
    they take). The ring alone, three chunks, takes next to nothing off: its first loads after
    the wrap wait for the stores of the chunks it loaded ahead."""
    staging = lambda n: n * chunks_ahead // 32  # noqa: E731
    sizes = [256, 256, 512, 1024] + [2048] * 24 + [1024, 512, 256, 256]  # tapered ends
    # The same transfers both ways: their bytes vary by a few with the host slab's address
    # residue (transfer.py), and the arena and its layout with them.
    _, _, transfers = _chunks(sizes)
    alone, _, _ = _critical_path(monkeypatch, staging, False, transfers)
    step, loaded, largest = _critical_path(monkeypatch, staging, True, transfers)
    assert loaded > 0 and step <= alone - (loaded - 2 * largest), (step, alone, loaded)
    if chunks_ahead == 16:
        assert step < 0.7 * alone
