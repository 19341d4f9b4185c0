"""The streaming engine on a GPU: races, leaks, and the memory the step adds."""

import re
from collections import defaultdict

import pytest
import torch

from muon_offload import Muon

pytestmark = pytest.mark.cuda


def _race_model(seed):
    """Little arithmetic, much state: many chunks cycle through the staging arena while the
    copies run long, so a missing event shows up as a wrong (or torn) update."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(128, 512)] * 24 + [(512, 128)] * 8 + [(1 << 21,)] * 6 + [(3001,)]
    return [torch.randn(s, generator=gen) for s in shapes]


def _run(init, steps, **kwargs):
    params = [torch.nn.Parameter(t.cuda()) for t in init]
    groups = [dict(params=params[:32]), dict(params=params[32:], algorithm="adamw")]
    opt = Muon(groups, lr=0.01, **kwargs)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        opt.step()
    torch.cuda.synchronize()
    return params, opt


def test_offloaded_equals_resident_bitwise_over_50_steps():
    init = _race_model(0)
    # The same units in both (resident chunks default to a larger budget): the same batches
    # of matrices, so the same products kernels, and bitwise equality tests the pipeline.
    same = dict(chunk_bytes=2 << 20, resident_chunk_bytes=2 << 20)
    resident, r_opt = _run(init, 50, **same)
    offloaded, o_opt = _run(init, 50, offload=True, **same)
    assert len(o_opt._store.streamed) == len(init)
    plan = next(iter(o_opt._plans.values()))[0]
    assert len(plan.chunks) > 10  # the staging arena wraps many times per step
    for a, b in zip(offloaded, resident, strict=True):
        assert torch.equal(a, b)
        for key in o_opt.state[a]:
            host = o_opt.state[a][key]
            assert host.device.type == "cpu" and host.is_pinned()
            assert torch.equal(host.cuda(), r_opt.state[b][key])


def test_reserved_memory_flat_over_100_steps():
    init = _race_model(1)
    params = [torch.nn.Parameter(t.cuda()) for t in init]
    # Eager: gradients made afresh every step land at the same addresses or not, so under
    # "auto" a graph (and its pool, reserved once) comes at a step chance picks (it failed
    # once so on the H200: +2 MiB at step 5). The eager step's own memory is what is checked.
    opt = Muon(
        [dict(params=params[:32]), dict(params=params[32:], algorithm="adamw")],
        offload=True,
        chunk_bytes=2 << 20,
        cuda_graph=False,
    )
    gen = torch.Generator(device="cuda").manual_seed(3)
    reserved = []
    for step in range(100):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        opt.step()
        torch.cuda.synchronize()
        if step >= 4:
            reserved.append(torch.cuda.memory_reserved())
    assert max(reserved) == min(reserved), (min(reserved), max(reserved))


def test_step_adds_little_gpu_memory_when_offloaded():
    init = _race_model(2)
    state_bytes = sum(t.numel() * 4 for t in init[:32]) + sum(t.numel() * 8 for t in init[32:])
    params, opt = _run(init, 2, offload=True, chunk_bytes=2 << 20)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    added = torch.cuda.max_memory_allocated() - base
    # A staging arena of three 2 MiB chunks is already held; the step adds Muon temporaries
    # for one unit (bf16 U and the orthogonalization's products) and pointer tables: far
    # below the state it streams.
    assert added < state_bytes / 4, (added, state_bytes)


def test_state_dict_reads_host_state_after_a_step():
    init = _race_model(3)
    params, opt = _run(init, 3, offload=True, chunk_bytes=2 << 20)
    before = torch.cuda.memory_allocated()
    sd = opt.state_dict()
    assert torch.cuda.memory_allocated() == before
    first = sd["state"][0]["momentum"]
    assert first.device.type == "cpu"
    assert torch.equal(first, opt.state[params[0]]["momentum"])


def test_state_dict_of_bench_workload_adds_no_gpu_memory():
    """The whole bench workload (14.55 GiB of fp32 state), offloaded: ``state_dict()`` hands
    out the pinned host slabs themselves. No byte of GPU memory is allocated or reserved by
    it, and no state tensor is copied (each one lies inside a slab), so saving costs what
    reading the host state costs; bench.py times both."""
    from muon_offload.tools.bench.modes import build
    from muon_offload.tools.workloads import qwen3_30b_a3b_ep8_rank

    groups, state_bytes, _ = build(qwen3_30b_a3b_ep8_rank(), torch.device("cuda"))
    opt = Muon(groups, lr=0.01, offload=True)
    opt.step()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    sd = opt.state_dict()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == allocated
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved

    slabs = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in opt._store.host.slabs]
    tensors = [t for values in sd["state"].values() for t in values.values() if torch.is_tensor(t)]
    nbytes = 0
    for t in tensors:
        if t.ndim == 0:  # AdamW's step counter is not streamed state
            continue
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert t.device.type == "cpu" and t.is_pinned()
        assert any(lo <= start and end <= hi for lo, hi in slabs), "state copied out of slabs"
        nbytes += t.numel() * t.element_size()
    assert nbytes == state_bytes


def test_dtensor_state_stays_in_host_slabs():
    """DTensor parameters on a CUDA mesh (world of one): their offloaded state is a DTensor
    around the pinned host slab itself. ``DTensor.from_local`` would have moved it to the GPU
    (it follows the mesh's device type), silently undoing the offload."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        init = _race_model(4)[:32]
        plain = [torch.nn.Parameter(t.cuda()) for t in init]
        shards = [
            torch.nn.Parameter(DTensor.from_local(t.cuda(), mesh, [Shard(0)], run_check=False))
            for t in init
        ]
        opts = [
            Muon(plain, lr=0.01, offload=True, chunk_bytes=2 << 20),
            Muon(shards, lr=0.01, offload=True, chunk_bytes=2 << 20, distributed_mesh=mesh),
        ]
        gen = torch.Generator(device="cuda").manual_seed(5)
        for _ in range(3):
            for p, d in zip(plain, shards, strict=True):
                p.grad = torch.randn(p.shape, device="cuda", generator=gen)
                d.grad = DTensor.from_local(p.grad.clone(), mesh, [Shard(0)], run_check=False)
            for opt in opts:
                opt.step()
        torch.cuda.synchronize()
        slabs = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in opts[1]._store.host.slabs]
        for p, d in zip(plain, shards, strict=True):
            assert torch.equal(d.to_local(), p)
            state = opts[1].state[d]["momentum"]
            assert isinstance(state, DTensor) and state.placements == d.placements
            inner = state.to_local()
            assert inner.device.type == "cpu" and inner.is_pinned()
            assert any(lo <= inner.data_ptr() < hi for lo, hi in slabs)
            assert torch.equal(inner, opts[0].state[p]["momentum"])
    finally:
        if owns_group:
            dist.destroy_process_group()


def _side_model(seed):
    """Muon matrices (compute-bound chunks) among many AdamW and Lion chunks, which the
    scheduler updates on its side stream beside them; a square AdamW matrix whose gradient is
    a transposed view, so its side-stream update allocates a contiguous copy."""
    gen = torch.Generator().manual_seed(seed)
    muon = [(512, 512)] * 12 + [(1024, 256)] * 8
    adamw = [(1 << 20,)] * 6 + [(768, 768), (3001,)]
    lion = [(1 << 20,)] * 2 + [(999,)]
    shapes = muon + adamw + lion
    return [torch.randn(s, generator=gen) for s in shapes], (len(muon), len(muon) + len(adamw))


def _run_side(init, split, side_lane, transposed, graph=False, steps=50, **kwargs):
    from muon_offload.engine.scheduler import StreamScheduler

    params = [torch.nn.Parameter(t.cuda()) for t in init]
    m, a = split
    groups = [
        dict(params=params[:m]),
        dict(params=params[m:a], algorithm="adamw", lr=3e-3, weight_decay=0.1),
        dict(params=params[a:], algorithm="lion", lr=1e-4),
    ]
    opt = Muon(groups, lr=0.02, cuda_graph=graph, **kwargs)
    opt._streams.scheduler = StreamScheduler(
        params[0].device, side_lane=side_lane
    )  # kept by step()
    for p in params:
        p.grad = torch.empty_like(p)
    if transposed:
        square = params[a - 2]
        square.grad = torch.empty_like(square).t()
    gen = torch.Generator(device="cuda").manual_seed(11)
    sums = []
    for _ in range(steps):
        # The compute stream is busy before it writes the gradients in place: a side stream
        # that did not wait for it would read the last step's gradients.
        torch.cuda._sleep(2_000_000)
        for p in params:
            p.grad.normal_(generator=gen)
        opt.step()
        # Read right after the step on the compute stream: a side update it did not wait
        # for would be missing from the sums.
        sums.append(torch.stack([p.sum(dtype=torch.float64) for p in params]))
    torch.cuda.synchronize()
    assert opt._streams.scheduler.side_lane == side_lane
    return params, opt, torch.stack(sums)


@pytest.mark.parametrize(
    ("state_dtype", "graph"), [(None, False), (torch.int8, False), (None, True)]
)
def test_side_stream_offloaded_equals_resident_bitwise_over_50_steps(state_dtype, graph):
    """Offloaded Muon + AdamW + Lion with the element-wise-only chunks updated and stored on
    the scheduler's side lane (2 MiB chunks: the arena wraps many times a step, element-wise
    chunks between Muon ones): 50 steps, weights, state and the weights read right after each
    step bitwise equal to the resident step with every update on the compute stream; the
    resident step with the side lane too. ``graph``: the offloaded step captured and
    replayed, the side streams forked from and joined into the capture."""
    init, split = _side_model(5)
    # The same units everywhere (resident chunks default to a larger budget): the same
    # batches of matrices, so the same products kernels.
    same = dict(chunk_bytes=2 << 20, resident_chunk_bytes=2 << 20, state_dtype=state_dtype)
    same["transposed"] = not graph  # a graph needs contiguous gradients
    ref, r_opt, r_sums = _run_side(init, split, side_lane=False, **same)
    runs = [
        _run_side(init, split, side_lane=True, **same),
        _run_side(init, split, side_lane=True, graph=graph, offload=True, **same),
    ]
    sched = runs[1][1]._streams.scheduler
    plan = next(iter(runs[1][1]._plans.values()))[0]
    kinds = "".join("e" if side else "M" for side in sched._on_side)
    assert kinds.count("M") >= 8 and re.search("Me+M", kinds), kinds  # side chunks between
    assert len(plan.chunks) == len(kinds) and all(not c.resident for c in plan.chunks)
    if graph:
        assert runs[1][1].graph_stats()["replays"] >= 45, runs[1][1].graph_stats()
    for params, opt, sums in runs:
        assert torch.equal(sums, r_sums)
        for a, b in zip(params, ref, strict=True):
            assert torch.equal(a, b)
            for key in opt.state[a]:
                assert torch.equal(opt.state[a][key].cuda(), r_opt.state[b][key])


def test_dropped_state_reuses_its_pinned_bytes_bitwise():
    """State dropped between steps (all of it, then some) is made afresh in the pinned bytes it
    left, once the last step's write-backs have landed: host memory stays flat and the steps
    equal resident state dropped the same way, bit for bit (a write-back landing after the
    bytes were zeroed for the new state would show)."""
    init = _race_model(2)
    same = dict(chunk_bytes=2 << 20, resident_chunk_bytes=2 << 20)
    runs = []
    for kwargs in (dict(offload=True, **same), same):
        params, opt = _run(init, 2, **kwargs)
        held = opt.host_state_bytes
        gen = torch.Generator(device="cuda").manual_seed(8)
        for s in range(4):
            if s % 2 == 0:
                opt.state = defaultdict(dict)
            else:
                for p in params[::3]:
                    del opt.state[p]
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=gen)
            opt.step()
            assert opt.host_state_bytes == held
        torch.cuda.synchronize()
        runs.append((params, opt))
    (offloaded, o_opt), (resident, r_opt) = runs
    assert o_opt.host_state_bytes > 0
    for a, b in zip(offloaded, resident, strict=True):
        assert torch.equal(a, b)
        for key in o_opt.state[a]:
            assert o_opt.state[a][key].is_pinned()
            assert torch.equal(o_opt.state[a][key].cuda(), r_opt.state[b][key])
