"""The streaming engine on a GPU: races, leaks, and the memory the step adds."""

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
    assert len(o_opt._streamed) == len(init)
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
    opt = Muon(
        [dict(params=params[:32]), dict(params=params[32:], algorithm="adamw")],
        offload=True,
        chunk_bytes=2 << 20,
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

    slabs = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in opt._host.slabs]
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
        slabs = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in opts[1]._host.slabs]
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
