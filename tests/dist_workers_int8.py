"""Worker bodies for tests/test_distributed_int8.py: 8-bit state of DTensor parameters, in
processes set up by dist_workers.py (gloo on CPUs; NCCL with MUON_OFFLOAD_TEST_BACKEND=nccl).

Blocks are counted over each rank's own shard (muon_offload/engine/sharded_scales.py): a
parameter whose shard boundaries all fall on block boundaries of the whole tensor (row-sharded
matrices of 256 columns, vectors of 6144 = 3 x 2048 elements, ...) gets the blocks, hence the
bits, of the unsharded run at any world size; the others get other blocks."""

import torch
import torch.distributed as dist
from muon_offload.kernels import quant_maps
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from muon_offload import Muon
from muon_offload.engine.sharded_scales import rank_major
from muon_offload.engine.state_format import Int8

from dist_workers import DEVICE, DEVICE_TYPE, _finish, _local, full_tensors, init, load_checkpoint

# Shard boundaries on block boundaries for 1, 2 and 3 ranks: 256 columns (any row cut is a
# block boundary), 12 x 512; a stack sharded along its batch (whole matrices; 3 ranks: 2, 2, 0).
MUON_ALIGNED = [(24, 256), (24, 256), (12, 512), (4, 24, 180)]
# Off block boundaries for 2 and 3 ranks: 20 x 130 = 2600 and 11 x 200 = 2200 elements a shard.
MUON_OTHER = [(40, 130), (22, 200)]
ADAMW_ALIGNED = [(6144,), (96, 64)]  # 3072 / 2048 elements a shard
ADAMW_OTHER = [(5000,), (33,)]  # 2500 / 1667; 33: under 4096 elements, dense fp32 state
LION = [(6144,)]
SHAPES = MUON_ALIGNED + MUON_OTHER + ADAMW_ALIGNED + ADAMW_OTHER + LION
ALIGNED = {i for i, s in enumerate(SHAPES) if s in MUON_ALIGNED + ADAMW_ALIGNED + LION}
N_MUON, N_ADAMW = len(MUON_ALIGNED + MUON_OTHER), len(ADAMW_ALIGNED + ADAMW_OTHER)


def build(mesh, distributed, **kwargs):
    def shard(t):
        return distribute_tensor(t, mesh, [Shard(0)]) if distributed else t.clone()

    params = [torch.nn.Parameter(shard(t)) for t in full_tensors(0, SHAPES)]
    groups = [
        dict(params=params[:N_MUON], nesterov=True),
        dict(params=params[N_MUON : N_MUON + N_ADAMW], algorithm="adamw"),
        dict(params=params[N_MUON + N_ADAMW :], algorithm="lion"),
    ]
    kwargs.setdefault("state_dtype", torch.int8)
    opt = Muon(groups, distributed_mesh=mesh if distributed else None, lr=0.02, **kwargs)
    return params, opt


def steps(params, opt, mesh, start, count, poison=None):
    """Gradients drawn whole (the same on every rank and world size), then sharded."""
    for s in range(start, start + count):
        gen = torch.Generator().manual_seed(100 + s)
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen)
            if poison is not None and (s, i) in poison:
                g.view(-1)[poison[(s, i)]] = float("nan")
            g = g.to(DEVICE)
            p.grad = distribute_tensor(g, mesh, p.placements) if isinstance(p, DTensor) else g
        opt.step()


def run(mesh, distributed, count=3, **kwargs):
    params, opt = build(mesh, distributed, **kwargs)
    steps(params, opt, mesh, 0, count)
    return params, opt


def dense_state(opt, p, key, kind):
    """This rank's state of ``key`` as fp32 (8-bit decoded), local."""
    state = opt.state[p]
    if key in state:
        return _local(state[key]).float()
    codes, scales = _local(state[f"{key}_codes"]), _local(state[f"{key}_scales"])
    return Int8(quant_maps.QBLOCK).decode(codes, scales, kind)


def kinds(i):
    if i < N_MUON:
        return (("momentum", "momentum"),)
    if i < N_MUON + N_ADAMW:
        return (("momentum", "adam_m"), ("variance", "adam_v"))
    return (("momentum", "momentum"),)


def my_part(mesh, full):
    """This rank's shard of a tensor every rank holds whole."""
    return distribute_tensor(full.to(DEVICE), mesh, [Shard(0)]).to_local().cpu()


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def equivalence(rank, world, port):
    mesh = init(rank, world, port)
    tiny = run(mesh, True, offload=True, chunk_bytes=1)
    # Offload on or off and any chunk size: the same bits, parameters and state.
    for other in [run(mesh, True)]:
        for a, b in zip(tiny[0], other[0], strict=True):
            assert torch.equal(_local(a), _local(b))
            assert tiny[1].state[a].keys() == other[1].state[b].keys()
            for key, value in tiny[1].state[a].items():
                assert torch.equal(_local(value), _local(other[1].state[b][key])), key
    # state_dict() -> load_state_dict() restores every shard's codes and scales (rank-major
    # scales, padded alike on every rank: 3 ranks hold 2, 2 and 0 matrices of the stack).
    twin = build(mesh, True)
    twin[1].load_state_dict(tiny[1].state_dict())
    for a, b in zip(tiny[0], twin[0], strict=True):
        for key, value in tiny[1].state[a].items():
            assert torch.equal(_local(value), _local(twin[1].state[b][key])), key
    # Every rank cuts the same chunks (Muon units: the collectives).
    plan = next(iter(tiny[1]._plans.values()))[0]
    units = repr([u for c in plan.chunks for u in c.units if hasattr(u, "params")])
    everyone = [None] * world
    dist.all_gather_object(everyone, units)
    assert all(u == everyone[0] for u in everyone)

    # Against one process holding whole tensors (every rank runs it).
    params, opt = tiny
    whole, whole_opt = run(mesh, False)
    worst = {}
    for i, (a, b) in enumerate(zip(params, whole, strict=True)):
        x0 = full_tensors(0, [SHAPES[i]])[0]
        mine, theirs = _local(a), my_part(mesh, b.detach())
        states = [
            (dense_state(opt, a, k, kind), my_part(mesh, dense_state(whole_opt, b, k, kind)))
            for k, kind in kinds(i)
        ]
        if i in ALIGNED or world == 1:
            # The blocks of the unsharded run: its 8-bit state exactly, and so (CPU) its update.
            for s, t in states:
                assert torch.equal(s, t), (SHAPES[i], world)
            if DEVICE_TYPE == "cpu" or i >= N_MUON:
                assert torch.equal(mine, theirs), SHAPES[i]
            else:  # on a GPU, Muon batches of another size round bf16 products differently
                assert rel(a.full_tensor() - x0, b.detach() - x0) < 1e-2
            continue
        # Other blocks: both runs round the same fp32 state to 8 bits, differently.
        worst[SHAPES[i]] = (
            rel(a.full_tensor() - x0, b.detach() - x0),
            max(rel(s, t) for s, t in states),
        )
    print(f"rank {rank}/{world}: off-block shapes, (update, state) relative diff: {worst}")
    for shape, (update, state) in worst.items():
        assert update < UPDATE_TOL and state < STATE_TOL, (shape, update, state)
    _finish()


# Off block boundaries, 3 steps, 2 and 3 ranks against one (CPU, 2026-12-02): decoded state up
# to 0.030 apart relative to its size (AdamW's variance; Muon's momentum 0.020), rounding noise
# of blocks that hold other elements; parameters' update up to 2.6e-4 (AdamW) and 2.1e-5
# (Muon). The bound on the update is the GPU's bf16 bound of the aligned case; a block given
# another's scale is off by tens of percent.
UPDATE_TOL, STATE_TOL = 1e-2, 6e-2


def _fsdp_model(mesh, state_dtype, **kwargs):
    """An FSDP2 model: an embedding (AdamW, 101 rows: uneven shards), two matrices (Muon, off
    block boundaries) and a bias (AdamW, dense: under 4096 elements)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(101, 64),
        torch.nn.Linear(64, 130),
        torch.nn.GELU(),
        torch.nn.Linear(130, 64, bias=False),
    ).to(DEVICE)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    mats = [p for n, p in named if p.ndim == 2 and not n.startswith("0.")]
    rest = [p for n, p in named if p.ndim < 2 or n.startswith("0.")]
    groups = [dict(params=mats), dict(params=rest, algorithm="adamw")]
    opt = Muon(groups, distributed_mesh=mesh, lr=0.02, state_dtype=state_dtype, **kwargs)
    return model, opt


def _train(model, opt, steps):
    for s in steps:
        x = torch.randint(0, 101, (8, 5), generator=torch.Generator().manual_seed(s))
        model(x.to(DEVICE)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _same(a_model, a_opt, b_model, b_opt):
    for a, b in zip(a_model.parameters(), b_model.parameters(), strict=True):
        assert torch.equal(_local(a), _local(b))
        assert a_opt.state[a].keys() == b_opt.state[b].keys()
        for key, value in a_opt.state[a].items():
            assert torch.equal(_local(value), _local(b_opt.state[b][key])), key


def checkpoints(rank, world, port, path):
    """torch.distributed.checkpoint of 8-bit state: saved offloaded at step 3, loaded into a
    resident optimizer with other chunks, resumed: bitwise the uninterrupted run. Dense state
    loads into 8-bit state quantized, 8-bit into dense decoded, as without a mesh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    mesh = init(rank, world, port)
    straight, straight_opt = _fsdp_model(mesh, torch.int8, offload=True, chunk_bytes=512)
    _train(straight, straight_opt, range(5))
    first, first_opt = _fsdp_model(mesh, torch.int8, offload=True, chunk_bytes=512)
    _train(first, first_opt, range(3))
    saved = get_optimizer_state_dict(first, first_opt)
    for fqn, entry in saved["state"].items():
        for name, value in entry.items():
            if name.endswith("_scales"):  # rank-major: one row a rank, padded alike
                assert isinstance(value, DTensor) and value.placements == (Shard(0),), fqn
                assert value.shape[0] == world and value.to_local().shape[0] == 1, fqn
    dcp.save({"model": get_model_state_dict(first), "optim": saved}, checkpoint_id=path)
    resumed, resumed_opt = _fsdp_model(mesh, torch.int8, chunk_bytes=1 << 20)
    load_checkpoint(resumed, resumed_opt, path)
    _same(first, first_opt, resumed, resumed_opt)
    _train(resumed, resumed_opt, range(3, 5))
    _same(straight, straight_opt, resumed, resumed_opt)

    # 8-bit into fp32 state: each rank decodes its own blocks.
    int8 = Int8(quant_maps.QBLOCK)
    _, dense = _fsdp_model(mesh, torch.float32)
    dense.load_state_dict(first_opt.state_dict())
    for key, kind, a, b in _quantized(first_opt, dense):
        codes, scales = (_local(first_opt.state[a][f"{key}_{n}"]) for n in ("codes", "scales"))
        assert isinstance(dense.state[b][key], DTensor)
        assert torch.equal(_local(dense.state[b][key]), int8.decode(codes, scales, kind)), key
    # fp32 and bf16 state into 8-bit: each rank encodes its own blocks, as the kernels do.
    for dtype in (torch.bfloat16, torch.float32):
        src_model, src = _fsdp_model(mesh, dtype)
        _train(src_model, src, range(2))
        _, direct = _fsdp_model(mesh, torch.int8)
        direct.load_state_dict(src.state_dict())
        for key, kind, a, b in _quantized(direct, src):
            codes, scales = (_local(direct.state[a][f"{key}_{n}"]) for n in ("codes", "scales"))
            want = int8.encode(_local(src.state[b][key]), kind, scales.shape)
            assert torch.equal(codes, want[0]) and torch.equal(scales, want[1]), key
    # The same through torch.distributed.checkpoint: an fp32 checkpoint read with an fp32
    # optimizer's state dict as the template, then set into an 8-bit optimizer.
    dcp.save({"optim": get_optimizer_state_dict(src_model, src)}, checkpoint_id=path + "-fp32")
    template_model, template = _fsdp_model(mesh, torch.float32)
    dense_sd = {"optim": get_optimizer_state_dict(template_model, template)}
    dcp.load(dense_sd, checkpoint_id=path + "-fp32")
    via_model, via = _fsdp_model(mesh, torch.int8)
    set_optimizer_state_dict(via_model, via, dense_sd["optim"])
    for (_, a), (_, b) in zip(via._params(), direct._params(), strict=True):
        for key, value in via.state[a].items():
            assert torch.equal(_local(value), _local(direct.state[b][key])), key
    _finish()


def _quantized(opt, other):
    """(key, code map, parameter of opt, parameter of other) of every 8-bit state key of opt;
    the two optimizers built alike."""
    for (gi, a), (_, b) in zip(opt._params(), other._params(), strict=True):
        algorithm = opt.algorithms[opt.param_groups[gi]["algorithm"]]
        for key, kind in zip(algorithm.state_keys, algorithm.state_kinds, strict=True):
            if f"{key}_codes" in opt.state[a]:
                yield key, kind, a, b


def bad_input(rank, world, port):
    """A NaN in one gradient element makes its own block's scale NaN, on the rank that holds
    it: every other block, of that parameter or another, keeps the bits of a clean run. And
    what cannot work is refused with a message: a placement without a scale layout, 8-bit
    scales saved from another layout."""
    mesh = init(rank, world, port)
    muon_i, adamw_i = 0, N_MUON  # (24, 256) and (6144,): the NaN in the last rank's shard
    poison = {(1, muon_i): 23 * 256 + 5, (1, adamw_i): 6000}
    clean, clean_opt = run(mesh, True, offload=True, chunk_bytes=3000)
    params, opt = build(mesh, True, offload=True, chunk_bytes=3000)
    steps(params, opt, mesh, 0, 3, poison)
    last = rank == world - 1
    for i, (a, b) in enumerate(zip(params, clean, strict=True)):
        if i != adamw_i and (i != muon_i or not last):
            for key, value in opt.state[a].items():  # Muon: this rank's momentum is its own
                assert torch.equal(_local(value), _local(clean_opt.state[b][key])), (i, key)
        if i not in (muon_i, adamw_i):
            assert torch.equal(_local(a), _local(b)), SHAPES[i]
    for i, element in ((muon_i, poison[(1, muon_i)]), (adamw_i, poison[(1, adamw_i)])):
        a, b = params[i], clean[i]
        block = None
        if last:  # the element's block of this rank's shard
            start = (element - b.numel() + _local(a).numel()) // quant_maps.QBLOCK
            block = slice(start * quant_maps.QBLOCK, (start + 1) * quant_maps.QBLOCK)
        for key, kind in kinds(i):
            got = dense_state(opt, a, key, kind).reshape(-1)
            want = dense_state(clean_opt, b, key, kind).reshape(-1)
            if block is not None:
                assert got[block].isnan().all(), key
                got, want = got.clone(), want.clone()
                got[block] = want[block] = 0
            assert torch.equal(got, want), (i, key)
    # AdamW (element-wise): the parameter's other blocks keep their update.
    got, want = _local(params[adamw_i]).clone(), _local(clean[adamw_i]).clone()
    if last:
        assert not got[block].isfinite().any()
        got[block] = want[block] = 0
    assert torch.equal(got, want)

    # Refused: a placement the scales have no layout for (Partial; also _StridedShard).
    odd = torch.nn.Parameter(DTensor.from_local(torch.randn(64, 64).to(DEVICE), mesh, [Partial()]))
    try:
        Muon([dict(params=[odd], algorithm="adamw")], distributed_mesh=mesh, state_dtype=torch.int8)
    except ValueError as err:
        assert "Shard and Replicate only" in str(err), err
    else:
        raise AssertionError("8-bit state of a Partial DTensor was accepted")
    # Refused: scales whose rows are shorter than this rank's (another world size's layout);
    # the optimizer is left as it was.
    sd = clean_opt.state_dict()
    p = clean[muon_i]
    sd["state"][muon_i] = dict(sd["state"][muon_i])
    scales = _local(clean_opt.state[p]["momentum_scales"])
    sd["state"][muon_i]["momentum_scales"] = rank_major(scales[:1], p, torch.Size((1,)))
    before = {k: _local(v).clone() for k, v in clean_opt.state[clean[adamw_i]].items()}
    try:
        clean_opt.load_state_dict(sd)
    except ValueError as err:
        assert "load at the world size they were saved at" in str(err), err
    else:
        raise AssertionError("scales of another layout were accepted")
    for key, value in clean_opt.state[clean[adamw_i]].items():
        assert torch.equal(_local(value), before[key])
    _finish()


def move_world_size(rank, world, port, path, stage):
    """An 8-bit checkpoint of sharded parameters to another world size, the documented way:
    "save" (2 ranks): 8-bit state saved, then read into a dense optimizer and saved dense;
    "load" (1 rank): the 8-bit checkpoint is refused by name, the dense one loads quantized."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    mesh = init(rank, world, port)
    model, opt = _fsdp_model(mesh, torch.int8)
    if stage == "save":
        _train(model, opt, range(3))
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path + "-8bit")
        dense_model, dense = _fsdp_model(mesh, torch.float32)
        set_optimizer_state_dict(dense_model, dense, get_optimizer_state_dict(model, opt))
        dcp.save({"optim": get_optimizer_state_dict(dense_model, dense)}, checkpoint_id=path)
        _finish()
    template_model, template = _fsdp_model(mesh, torch.float32)
    try:
        state = {"optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path + "-8bit")
    except BaseException as err:  # DCP's CheckpointException wraps the planner's ValueError
        assert "Size mismatch" in str(err) and "momentum_scales" in str(err), err
    else:
        raise AssertionError("an 8-bit checkpoint of 2 ranks loaded on 1")
    dense_sd = {"optim": get_optimizer_state_dict(template_model, template)}
    dcp.load(dense_sd, checkpoint_id=path)
    set_optimizer_state_dict(template_model, template, dense_sd["optim"])
    set_optimizer_state_dict(model, opt, dense_sd["optim"])
    int8 = Int8(quant_maps.QBLOCK)
    for key, kind, a, b in _quantized(opt, template):
        codes, scales = (_local(opt.state[a][f"{key}_{n}"]) for n in ("codes", "scales"))
        want = int8.encode(_local(template.state[b][key]), kind, scales.shape)
        assert torch.equal(codes, want[0]) and torch.equal(scales, want[1]), key
    assert [g["step"] for g in opt.param_groups] == [3, 3]
    _finish()
