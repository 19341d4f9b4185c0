"""Worker bodies for tests/test_distributed.py: each runs in its own process (gloo, CPU) and
raises on a failed check, which fails the spawning test."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from muon_offload import Muon

if os.environ.get("TRITON_INTERPRET") == "1":  # as in the tests' own process (conftest.py)
    from _interpreter_speed import cache_builtin_names

    cache_builtin_names()

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

    # Every rank cuts the same Muon chunks and runs them in the same order: compare the plans
    # across ranks (element-wise chunks, cut on local sizes and with no collective, run
    # between them and may fall elsewhere on another rank: planner.interleave).
    plan = next(iter(tiny[1]._plans.values()))[0]
    muon_chunks = [[u for u in c.units if u.algorithm == "muon"] for c in plan.chunks]
    muon_chunks = [units for units in muon_chunks if units]
    assert len(muon_chunks) > 1 and len(muon_chunks) < len(plan.chunks)
    everyone = [None] * world
    dist.all_gather_object(everyone, repr(muon_chunks))
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


def mesh_keeps_its_ends(rank, world, port):
    """A step on a mesh of several ranks keeps its ends (engine/step_plans.py): its units
    issue collectives, which the taper's extra units would multiply; the same parameters on
    each rank alone are tapered (the floor lowered to these sizes)."""
    from muon_offload.engine import step_plans
    from muon_offload.engine import taper as taper_module

    mesh = init(rank, world, port)
    taper_module.TAPER_FLOOR = 1
    tapered, real = [], step_plans.taper
    step_plans.taper = lambda *args: tapered.append(args) or real(*args)
    run(mesh, True, steps=1, chunk_bytes=4096, offload=True)
    assert tapered == []
    run(mesh, False, steps=1, chunk_bytes=4096, offload=True)
    assert tapered
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
    mesh = init(rank, world, port)
    full = full_tensors(5, [(12, 16)] * 3)
    # chunk_bytes smaller than one block: the packed weight must still go once (a block
    # updated twice would be ~100% off).
    _sharded_against_one(mesh, full, [[Shard(0)]] * 3, dict(split_sizes=(4, 8)), chunk_bytes=1)
    _finish()


def _sharded_against_one(mesh, full, place, group: dict, chunk_bytes: int) -> None:
    """Two offloaded steps of ``full`` (float64 orthogonalization) as DTensors placed by
    ``place`` over ``mesh`` and as plain tensors on one process: the updates agree to within
    1e-5 relative."""
    from reference64 import orthogonalize64_batch

    results = []
    for distributed in (True, False):
        params = [
            # A clone each: a replicated DTensor may hold the very tensor it was made from.
            torch.nn.Parameter(distribute_tensor(t.clone(), mesh, pl) if distributed else t.clone())
            for t, pl in zip(full, place, strict=True)
        ]
        opt = Muon(
            [dict(params=params, **group)],
            distributed_mesh=mesh if distributed else None,
            newton_schulz_func=orthogonalize64_batch,
            chunk_bytes=chunk_bytes,
            offload=True,
        )
        for s in range(2):
            set_grads(params, s, mesh)
            opt.step()
        results.append([p.full_tensor() if distributed else p.detach() for p in params])
    for a, b, x0 in zip(*results, full, strict=True):
        rel = ((a - x0) - (b - x0)).norm() / (b - x0).norm()
        assert rel < 1e-5, rel.item()


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
    # dion's update functions run eagerly: torch.compile would compile them afresh in every
    # process (about 7 s of each run here) for the same arithmetic.
    with torch.compiler.set_stance("force_eager"):
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


def load_checkpoint(model, opt, path) -> None:
    """Load a torch.distributed.checkpoint of ``{"model", "optim"}`` into ``model`` and
    ``opt``, through the state-dict API (as a training script resumes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def dcp_resume(rank, world, port, path):
    """Save through torch.distributed.checkpoint at step 3 with FSDP2 parameters, load into a
    fresh model and optimizer (other chunk size), continue: bitwise the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
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
    load_checkpoint(resumed, resumed_opt, path)
    assert [g["step"] for g in resumed_opt.param_groups] == [3, 3]
    train(resumed, resumed_opt, range(3, 5))
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(_local(a), _local(b))
        for key, value in resumed_opt.state[a].items():
            assert torch.equal(_local(value), _local(straight_opt.state[b][key])), key
    _finish()


# ---------------------------------------------------------------- rank agreement
# Every rank of a mesh must step the same parameters: muon_offload/distributed/rank_agreement.py.


def _agreement_message(call):
    try:
        call()
    except ValueError as err:
        return str(err)
    raise AssertionError("the ranks disagreed and nothing was raised")


def agreement_direct(rank, world, port):
    """StepAgreement on a gloo mesh: agreeing lists pass; a position missing on the last rank
    raises on every rank, naming that position's parameter and the ranks."""
    from muon_offload.distributed.rank_agreement import StepAgreement, fingerprint

    init(rank, world, port)
    from muon_offload.distributed import resolve_mesh

    agreement = StepAgreement(resolve_mesh(dist.group.WORLD))
    assert agreement.group is dist.group.WORLD  # gloo already: reused, no new group
    names = {i: f"parameter #{i}" for i in range(10)}
    for stepping in ([], [0], [0, 1, 2, 5, 9], list(range(10))):
        agreement.check(stepping, names.__getitem__)
    # The fingerprint is the same in every process (Python's hash() is salted per process).
    everyone = [None] * world
    dist.all_gather_object(everyone, fingerprint([0, 3, 7]))
    assert len(set(everyone)) == 1, everyone
    last = world - 1
    stepping = [0, 1, 2, 5, 9] if rank != last else [0, 1, 5, 9]
    message = _agreement_message(lambda: agreement.check(stepping, names.__getitem__))
    have = ", ".join(map(str, range(last)))
    assert message.startswith(f"parameter #2 has a gradient on rank{'s' if last > 1 else ''} "), (
        message
    )
    assert f" {have} but not on rank {last} " in message, message
    # Extra on one rank only: the first differing position is named (7, not 9).
    stepping = [0, 7, 9] if rank == 0 else [0, 9]
    message = _agreement_message(lambda: agreement.check(stepping, names.__getitem__))
    assert message.startswith("parameter #7 has a gradient on rank 0 but not on rank"), message
    # The same positions, a gradient dtype that differs on the last rank: named, with both.
    dtypes = ["torch.float32", "torch.bfloat16" if rank == last else "torch.float32"]
    message = _agreement_message(lambda: agreement.check([3, 4], names.__getitem__, dtypes))
    assert message.startswith(
        f"parameter #4 has a torch.float32 gradient on rank{'s' if last > 1 else ''} {have} "
        f"but a torch.bfloat16 gradient on rank {last} "
    ), message
    agreement.check([3, 4], names.__getitem__, ["torch.float32"] * 2)
    # Still paired after the errors.
    agreement.check([1, 2], names.__getitem__)

    # The optimizer's side: one agreement per mesh; positions run over the mesh's groups in
    # turn (a group without a mesh takes no part); the error names group and parameter.
    from muon_offload.distributed import LOCAL
    from muon_offload.distributed.rank_agreement import StepAgreements

    world_mesh = resolve_mesh(dist.group.WORLD)
    groups = [dict(params=[torch.zeros(2, 3) for _ in range(2)]) for _ in range(3)]
    meshes = [world_mesh, LOCAL, world_mesh]
    agreements = StepAgreements()
    agreements.add(groups, meshes.__getitem__)
    for g in groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    groups[1]["params"][0].grad = None  # no mesh: not compared
    agreements.check(groups, meshes.__getitem__)
    kept = groups[0]["params"][1]
    if rank == last:  # the step batches by gradient dtype: a bf16 gradient on one rank only
        groups[0]["params"][1] = torch.zeros(2, 3, dtype=torch.bfloat16)
        groups[0]["params"][1].grad = torch.zeros(2, 3, dtype=torch.bfloat16)
    message = _agreement_message(lambda: agreements.check(groups, meshes.__getitem__))
    assert message.startswith("param group 0 (parameter 1 of the group, of shape (2, 3)) has a"), (
        message
    )
    assert "torch.bfloat16 gradient on rank" in message, message
    groups[0]["params"][1] = kept
    if rank == last:
        groups[2]["params"][1].grad = None
    message = _agreement_message(lambda: agreements.check(groups, meshes.__getitem__))
    assert message.startswith("param group 2 (parameter 1 of the group, of shape (2, 3)) has"), (
        message
    )
    _finish()


def agreement_twins(rank, world, port):
    """Meshes whose groups have no gloo backend get a gloo twin over the same ranks, made
    collectively over the WORLD even though each rank's groups differ (dp groups {0,1} and
    {2,3}, ep groups {0,2} and {1,3}). Forced here on gloo groups by hiding their backend."""
    from muon_offload.distributed import rank_agreement, resolve_mesh

    mesh2d = init(rank, world, port, (2, world // 2), ("dp", "ep"))
    rank_agreement._has_cpu_gloo = lambda group: False
    dp, ep = resolve_mesh(mesh2d["dp"]), resolve_mesh(mesh2d["ep"])
    agree_dp = rank_agreement.StepAgreement(dp)
    agree_ep = rank_agreement.StepAgreement(ep)
    for mesh, agreement in ((dp, agree_dp), (ep, agree_ep)):
        assert agreement.group is not mesh.group
        assert dist.get_backend(agreement.group) == "gloo"
        assert agreement.ranks == sorted(dist.get_process_group_ranks(mesh.group))
    # Cached: a second optimizer on the same mesh makes no group and needs no collective.
    assert rank_agreement.StepAgreement(ep).group is agree_ep.group
    names = str
    assert agree_dp.disagreement([0, 1], names) is None
    # The ep group holding the last rank disagrees; the other ep group and the dp groups agree.
    last = world - 1
    ep_stepping = [0, 1] if rank != last else [1]
    message = agree_ep.disagreement(ep_stepping, names)
    last_ep_group = dist.get_process_group_ranks(ep.group)
    if last in last_ep_group:
        others = [r for r in last_ep_group if r != last]
        assert message.startswith(f"0 has a gradient on rank {others[0]} but not on rank {last}")
    else:
        assert message is None, message
    assert agree_dp.disagreement([3], names) is None  # still paired
    _finish()


def agreement_cost(rank, world, port, path):
    """Microseconds per check on a gloo mesh of ``world`` CPU processes, written by rank 0."""
    import json
    import time

    from muon_offload.distributed import resolve_mesh
    from muon_offload.distributed.rank_agreement import StepAgreement, fingerprint

    init(rank, world, port)
    agreement = StepAgreement(resolve_mesh(dist.group.WORLD))
    result = {}
    for n in (10, 200, 2000):
        stepping = list(range(n))
        for _ in range(50):
            agreement.check(stepping, str)
        best = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(200):
                agreement.check(stepping, str)
            best.append((time.perf_counter() - t0) / 200 * 1e6)
        t0 = time.perf_counter()
        for _ in range(1000):
            fingerprint(stepping)
        result[n] = {
            "check_us_median": sorted(best)[len(best) // 2],
            "check_us_min": min(best),
            "fingerprint_us": (time.perf_counter() - t0) / 1000 * 1e6,
        }
    # The floor: the same all-reduce alone, on a preallocated tensor.
    both = torch.zeros(2, dtype=torch.int64)
    bare = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
        bare.append((time.perf_counter() - t0) / 200 * 1e6)
    result["bare_all_reduce_us_median"] = sorted(bare)[len(bare) // 2]
    if rank == 0:
        with open(path, "w") as f:
            json.dump(result, f)
    _finish()


def _agreement_snapshot(params, opt):
    state = {
        i: {k: _local(v).clone() for k, v in opt.state[p].items()}
        for i, p in enumerate(params)
        if p in opt.state
    }
    return [_local(p).clone() for p in params], state, [g["step"] for g in opt.param_groups]


def _agreement_same(a, b):
    assert len(a[0]) == len(b[0]) and a[2] == b[2], (a[2], b[2])
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    assert a[1].keys() == b[1].keys()
    for i in a[1]:
        assert a[1][i].keys() == b[1][i].keys()
        for k in a[1][i]:
            assert torch.equal(a[1][i][k], b[1][i][k]), (i, k)


def agreement_muon_none_on_one_rank(rank, world, port):
    """Muon end to end (needs the optimizer to call StepAgreements.check in step()): rank 1's
    gradient of one sharded matrix is None. Every rank raises ValueError naming it, before
    anything moves; afterwards agreed steps run on and match a run that never failed."""
    mesh = init(rank, world, port)
    kwargs = dict(lr=0.02, offload=True, chunk_bytes=3000)

    def fresh():
        params, groups = build(mesh, True)
        return params, Muon(groups, distributed_mesh=mesh, **kwargs)

    params, opt = fresh()
    for first in (True, False):  # before any state exists, and after a step
        if not first:
            set_grads(params, 0, mesh)
            opt.step()
        before = _agreement_snapshot(params, opt)
        set_grads(params, 1, mesh)
        if rank == 1:
            params[1].grad = None  # param group 0, parameter 1: a (24, 40) matrix, sharded
        message = _agreement_message(opt.step)
        assert message.startswith(
            "param group 0 (parameter 1 of the group, of shape (24, 40)) has a gradient on "
            "rank 0 but not on rank 1"
        ), message
        _agreement_same(_agreement_snapshot(params, opt), before)
        # Before the first step: the state made at construction, untouched (all zeros).
        assert not first or not any(_local(t).any() for v in opt.state.values() for t in v.values())
    set_grads(params, 1, mesh)
    opt.step()
    ref_params, ref_opt = fresh()
    for s in (0, 1):
        set_grads(ref_params, s, mesh)
        ref_opt.step()
    _agreement_same(_agreement_snapshot(params, opt), _agreement_snapshot(ref_params, ref_opt))
    _finish()


def agreement_muon_agreed(rank, world, port):
    """All ranks agree (some gradients None on every rank in one step): the steps are bitwise
    those without the agreement check (StepAgreements.check made a no-op)."""
    from muon_offload.distributed import rank_agreement

    mesh = init(rank, world, port)
    results = []
    for check in (rank_agreement.StepAgreements.check, lambda self, *args: None):
        rank_agreement.StepAgreements.check = check
        params, groups = build(mesh, True)
        opt = Muon(groups, distributed_mesh=mesh, lr=0.02, offload=True, chunk_bytes=3000)
        for s in range(3):
            set_grads(params, s, mesh)
            if s == 1:
                for i in (0, 3, len(params) - 1):
                    params[i].grad = None
            opt.step()
        results.append(_agreement_snapshot(params, opt))
    _agreement_same(*results)
    _finish()


def heads(rank, world, port):
    """``num_heads`` weights sharded on dim 0 (whole heads on every rank, orthogonalized where
    they are) and replicated, against the same weights on one process; the other shardings
    refused at construction, as dion refuses them."""
    from torch.distributed.tensor import Replicate

    mesh = init(rank, world, port)
    full = full_tensors(6, [(32, 24), (32, 24), (48, 16)])  # heads of 8 and 12 rows
    place = [[Shard(0)], [Replicate()], [Shard(0)]]
    # (a head cut across ranks would be far off)
    _sharded_against_one(mesh, full, place, dict(num_heads=4), chunk_bytes=4000)
    for pl, num_heads, what in (([Shard(1)], 4, "dim 0"), ([Shard(0)], 3, "multiple")):
        p = torch.nn.Parameter(distribute_tensor(full[0][:24].clone(), mesh, pl))
        try:
            Muon([dict(params=[p], num_heads=num_heads)], distributed_mesh=mesh)
        except (ValueError, NotImplementedError) as err:
            assert what in str(err), err
        else:
            raise AssertionError(f"num_heads={num_heads} with {pl} was accepted")
    _finish()
