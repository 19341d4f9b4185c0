"""Worker bodies for tests/test_distributed.py: each runs in its own process (gloo, CPU) and
raises on a failed check, which fails the spawning test."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from muon_offload import Muon

# Even and uneven dim 0 for 2 and 3 ranks (24: even; 22: 11+11, 8+8+6; 40: 20+20, 14+14+12;
# 2: 1+1, 1+1+0, an empty shard), wide and tall, and a stack sharded along its batch dim.
SHARDED = [(24, 40), (24, 40), (24, 40), (22, 40), (22, 40), (40, 14), (40, 14), (2, 32)]
BATCH_SHARDED = [(4, 12, 20)]
REPLICATED = [(16, 24), (16, 24)]
ADAMW = [(33,)]
LION = [(5,)]


def _finish():
    """Leave the process once its checks passed. gloo with DTensor can abort in interpreter
    teardown ("terminate called without an active exception"; reproduced with
    distribute_tensor and full_tensor alone, about 1 run in 6, torch 2.13 CPU), after the work
    is done: skip the teardown so that only a failed check fails a test."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# gloo on CPUs (CI) by default; MUON_OFFLOAD_TEST_BACKEND=nccl runs the same checks with one
# GPU per process, where the offloaded steps take the real stream pipeline.
BACKEND = os.environ.get("MUON_OFFLOAD_TEST_BACKEND", "gloo")
DEVICE_TYPE = "cuda" if BACKEND == "nccl" else "cpu"
DEVICE = torch.device("cpu")  # this process's device, set by init()


def init(rank, world, port, mesh_shape=None, mesh_dim_names=None):
    global DEVICE
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if DEVICE_TYPE == "cuda":
        torch.cuda.set_device(rank)
        DEVICE = torch.device("cuda", rank)
    dist.init_process_group(BACKEND, rank=rank, world_size=world)
    return init_device_mesh(DEVICE_TYPE, mesh_shape or (world,), mesh_dim_names=mesh_dim_names)


def full_tensors(seed, shapes):
    """The same values on every rank and backend: drawn on the CPU, then moved."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(DEVICE) for s in shapes]


def build(mesh, distributed):
    """(params, groups) from the same full tensors on every rank; sharded when distributed."""
    init = full_tensors(0, SHARDED + BATCH_SHARDED + REPLICATED + ADAMW + LION)
    n2, n3 = len(SHARDED) + 1, len(SHARDED) + 1 + len(REPLICATED)

    def shard(t):
        return distribute_tensor(t, mesh, [Shard(0)]) if distributed else t.clone()

    params = [torch.nn.Parameter(shard(t)) for t in init[:n2]]
    params += [torch.nn.Parameter(t.clone()) for t in init[n2:n3]]
    params += [torch.nn.Parameter(shard(t)) for t in init[n3 : n3 + 1]]
    params += [torch.nn.Parameter(t.clone()) for t in init[n3 + 1 :]]
    groups = [
        dict(params=params[:n2], nesterov=True),
        dict(params=params[n2:n3]),
        dict(params=params[n3 : n3 + 1], algorithm="adamw"),
        dict(params=params[n3 + 1 :], algorithm="lion"),
    ]
    return params, groups


def set_grads(params, step, mesh):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        g = torch.randn(p.shape, generator=gen).to(DEVICE)
        p.grad = distribute_tensor(g, mesh, p.placements) if isinstance(p, DTensor) else g


def run(mesh, distributed, steps=3, **kwargs):
    params, groups = build(mesh, distributed)
    opt = Muon(groups, distributed_mesh=mesh if distributed else None, lr=0.02, **kwargs)
    for s in range(steps):
        set_grads(params, s, mesh)
        opt.step()
    return params, opt


def _local(t):
    """A rank's own values, on the CPU: offloaded state lives there, resident state and the
    parameters on this rank's device (a GPU under NCCL), and torch.equal needs one device."""
    return (t.to_local() if isinstance(t, DTensor) else t).cpu()


def equivalence(rank, world, port):
    mesh = init(rank, world, port)
    tiny = run(mesh, True, chunk_bytes=1, offload=True)
    whole = run(mesh, True, chunk_bytes=1 << 30)
    # Chunked (and offloaded, through the CPU path) == unchunked, bitwise, on every rank.
    for a, b in zip(tiny[0], whole[0], strict=True):
        assert torch.equal(_local(a), _local(b))
        for key, value in tiny[1].state[a].items():
            # State of a DTensor parameter is a DTensor laid out like it.
            assert isinstance(value, DTensor) == isinstance(a, DTensor)
            assert getattr(value, "placements", None) == getattr(a, "placements", None)
            assert torch.equal(_local(value), _local(whole[1].state[b][key])), key

    # Every rank cuts the same chunks: compare the plans across ranks.
    plan = next(iter(tiny[1]._plans.values()))[0]
    muon_units = [u for c in plan.chunks for u in c.units if hasattr(u, "params")]
    everyone = [None] * world
    dist.all_gather_object(everyone, repr(muon_units))
    assert all(p == everyone[0] for p in everyone), everyone

    # Against one process holding the full tensors, both with the float64 orthogonalizer of
    # reference64.py so the comparison is not blurred by bf16: the all-to-alls, the padding of
    # uneven and empty shards and the all-gathers must be exact up to fp32 rounding.
    from reference64 import orthogonalize64_batch

    ours = run(mesh, True, newton_schulz_func=orthogonalize64_batch)
    single = run(mesh, False, newton_schulz_func=orthogonalize64_batch)
    start = full_tensors(0, SHARDED + BATCH_SHARDED + REPLICATED + ADAMW + LION)
    for a, b, x0 in zip(ours[0], single[0], start, strict=True):
        full = a.full_tensor() if isinstance(a, DTensor) else a
        rel = ((full - x0) - (b - x0)).norm() / (b - x0).norm()
        assert rel < 1e-5, (tuple(full.shape), rel.item())
    _finish()


def without_list_all_to_all(rank, world, port):
    """gloo before torch 2.12 has no list-form all_to_all (pytorch PR 165435): the sharded
    exchange must not need it. Same result as the plain run of ``equivalence``."""
    mesh = init(rank, world, port)

    def missing(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support alltoall")

    dist.all_to_all = missing
    chunked = run(mesh, True, chunk_bytes=1, offload=True)
    whole = run(mesh, True, chunk_bytes=1 << 30)
    for a, b in zip(chunked[0], whole[0], strict=True):
        assert torch.equal(_local(a), _local(b))
    _finish()


def packed_once(rank, world, port):
    from reference64 import orthogonalize64_batch

    mesh = init(rank, world, port)
    full = full_tensors(5, [(12, 16)] * 3)
    results = []
    for distributed in (True, False):
        params = [
            torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]) if distributed else t.clone())
            for t in full
        ]
        opt = Muon(
            [dict(params=params, split_sizes=(4, 8))],
            distributed_mesh=mesh if distributed else None,
            newton_schulz_func=orthogonalize64_batch,
            chunk_bytes=1,  # smaller than one block: the packed weight must still go once
            offload=True,
        )
        for s in range(2):
            set_grads(params, s, mesh)
            opt.step()
        results.append([p.full_tensor() if distributed else p.detach() for p in params])
    for a, b, x0 in zip(*results, full, strict=True):
        rel = ((a - x0) - (b - x0)).norm() / (b - x0).norm()
        assert rel < 1e-5, rel.item()  # a block updated twice would be ~100% off
    _finish()


def fsdp2(rank, world, port):
    from torch.distributed.fsdp import fully_shard

    mesh = init(rank, world, port)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 16, bias=False)
    )
    reference = torch.nn.Sequential(
        torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 16, bias=False)
    )
    reference.load_state_dict(model.state_dict())
    model.to(DEVICE)
    reference.to(DEVICE)
    fully_shard(model, mesh=mesh)

    def groups(m):
        mats = [p for p in m.parameters() if p.ndim == 2]
        vecs = [p for p in m.parameters() if p.ndim < 2]
        return [dict(params=mats), dict(params=vecs, algorithm="adamw")]

    opt = Muon(groups(model), distributed_mesh=mesh, lr=0.02, offload=True, chunk_bytes=512)
    ref_opt = Muon(groups(reference), lr=0.02)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 16, generator=gen).to(DEVICE)
        for m, o in ((model, opt), (reference, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        full = p.full_tensor()
        torch.testing.assert_close(full, q.detach(), rtol=0, atol=1e-3, msg=name)
    _finish()


def mismatches(rank, world, port):
    mesh = init(rank, world, port)
    # Shapes that differ across ranks: refused at construction, on every rank.
    p = torch.nn.Parameter(torch.randn(4 + rank, 8, device=DEVICE))
    try:
        Muon([p], distributed_mesh=dist.group.WORLD)
    except ValueError as err:
        assert "differ across ranks" in str(err)
    else:
        raise AssertionError("mismatched shapes were accepted")
    # A DTensor sharded over a mesh other than its group's (its own process group).
    from torch.distributed.device_mesh import DeviceMesh

    other = DeviceMesh.from_group(dist.new_group(list(range(world))), DEVICE_TYPE)
    q = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8, device=DEVICE), other, [Shard(0)]))
    try:
        Muon([dict(params=[q], distributed_mesh=mesh)])
    except ValueError as err:
        assert "other than its param group" in str(err), err
    else:
        raise AssertionError("a DTensor on another mesh was accepted")
    # DTensor parameters without a DeviceMesh.
    try:
        Muon([q])
    except ValueError as err:
        assert "need a DeviceMesh" in str(err)
    else:
        raise AssertionError("DTensor without a mesh was accepted")
    _finish()


def two_sharded_dims(rank, world, port):
    mesh2d = init(rank, world, port, (2, world // 2), ("a", "b"))
    full = torch.randn(8, 8, device=DEVICE)
    p = torch.nn.Parameter(distribute_tensor(full, mesh2d, [Shard(0), Shard(1)]))
    try:
        Muon([p], distributed_mesh=mesh2d["a"])
    except ValueError as err:
        assert "more than one dim" in str(err), err
    else:
        raise AssertionError("a parameter sharded on two dims was accepted")
    _finish()


def against_dion(rank, world, port):
    """dion's Muon on the same mesh, both given the float64 orthogonalizer of reference64.py:
    then the collectives, padding and the rest must agree to fp32 rounding, the bound of the
    single-device comparison (tests/test_vs_dion.py)."""
    import dion

    from reference64 import orthogonalize64_batch

    mesh = init(rank, world, port)
    ours = run(mesh, True, newton_schulz_func=orthogonalize64_batch)
    params, groups = build(mesh, True)
    ref = dion.Muon(
        groups, distributed_mesh=mesh, lr=0.02, newton_schulz_func=orthogonalize64_batch
    )
    for s in range(3):
        set_grads(params, s, mesh)
        ref.step()
    start = full_tensors(0, SHARDED + BATCH_SHARDED + REPLICATED + ADAMW + LION)
    for a, b, x0 in zip(ours[0], params, start, strict=True):
        fa = a.full_tensor() if isinstance(a, DTensor) else a.detach()
        fb = b.full_tensor() if isinstance(b, DTensor) else b.detach()
        rel = ((fa - x0) - (fb - x0)).norm() / (fb - x0).norm()
        assert rel < 1e-5, (tuple(fa.shape), rel.item())
    _finish()


def world_of_one(rank, world, port):
    """A one-rank mesh (DTensor) and a one-rank ProcessGroup take the distributed code paths
    and must give exactly the plain step."""
    mesh = init(rank, world, port)
    plain = run(mesh, False, offload=True, chunk_bytes=3000)
    sharded = run(mesh, True, offload=True, chunk_bytes=3000)
    for a, b in zip(sharded[0], plain[0], strict=True):
        assert torch.equal(_local(a), _local(b))
    params, groups = build(mesh, False)
    opt = Muon(groups, distributed_mesh=dist.group.WORLD, lr=0.02, offload=True, chunk_bytes=3000)
    for s in range(3):
        set_grads(params, s, mesh)
        opt.step()
    for a, b in zip(params, plain[0], strict=True):
        assert torch.equal(_local(a), _local(b))
    _finish()


def dcp_resume(rank, world, port, path):
    """Save through torch.distributed.checkpoint at step 3 with FSDP2 parameters, load into a
    fresh model and optimizer (other chunk size), continue: bitwise the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    mesh = init(rank, world, port)

    def make(chunk_bytes):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 30), torch.nn.GELU(), torch.nn.Linear(30, 16, bias=False)
        ).to(DEVICE)
        fully_shard(model, mesh=mesh)
        mats = [p for p in model.parameters() if p.ndim == 2]
        vecs = [p for p in model.parameters() if p.ndim < 2]
        groups = [dict(params=mats), dict(params=vecs, algorithm="adamw")]
        opt = Muon(groups, distributed_mesh=mesh, lr=0.02, offload=True, chunk_bytes=chunk_bytes)
        return model, opt

    def train(model, opt, steps):
        for s in steps:
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(s)).to(DEVICE)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    straight, straight_opt = make(512)
    train(straight, straight_opt, range(5))

    first, first_opt = make(512)
    train(first, first_opt, range(3))
    dcp.save(
        {"model": get_model_state_dict(first), "optim": get_optimizer_state_dict(first, first_opt)},
        checkpoint_id=path,
    )
    resumed, resumed_opt = make(1 << 20)
    state = {
        "model": get_model_state_dict(resumed),
        "optim": get_optimizer_state_dict(resumed, resumed_opt),
    }
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, resumed_opt, state["optim"])
    assert [g["step"] for g in resumed_opt.param_groups] == [3, 3]
    train(resumed, resumed_opt, range(3, 5))
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(_local(a), _local(b))
        for key, value in resumed_opt.state[a].items():
            assert torch.equal(_local(value), _local(straight_opt.state[b][key])), key
    _finish()
