"""CUDA graphs of steps with a ``distributed_mesh`` and DTensor parameters, on one GPU: a
process group of one rank over NCCL, a 1-device mesh, FSDP2-style ``Shard(0)`` DTensors (and
a group of plain tensors on the same mesh). The steps capture and replay (``graph_stats``)
and equal eager steps bit for bit, with fresh gradients every step; fp32 and 8-bit state,
resident and offloaded. One rank issues no collective (every matrix is whole on it): this
covers what a sharded step's graph reads (shards' addresses, the gradient table of DTensor
gradients, the key); NCCL collectives under capture need two GPUs
(``MUON_OFFLOAD_TEST_BACKEND=nccl`` with tests/test_distributed.py's workers).

Run: ``python -m pytest -q -m cuda tests/test_gpu_graph_mesh.py``."""

import pytest
import torch
import torch.distributed as dist

from muon_offload import Muon

pytestmark = pytest.mark.cuda

SHAPES = [(128, 256)] * 4 + [(256, 64)] * 2 + [(4, 32, 48)] + [(3001,)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh

    path = tmp_path_factory.mktemp("nccl") / "init"
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


def _make(mesh, graph, with_mesh_group, **kw):
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen).cuda() for s in SHAPES]
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full[:-1]]
    params.append(torch.nn.Parameter(full[-1].clone()))
    groups = [dict(params=params[:-2]), dict(params=params[-2:-1])]
    if with_mesh_group:  # plain tensors on the mesh (DDP's replicated matrices)
        groups.append(dict(params=params[-1:], algorithm="adamw", lr=3e-3))
    else:
        groups.append(dict(params=params[-1:], algorithm="lion", lr=1e-4))
    opt = Muon(groups, distributed_mesh=mesh, lr=0.02, cuda_graph=graph, **kw)
    return params, opt


def _grads(params, step):
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    for p in params:
        g = torch.randn(p.shape, device="cuda", generator=gen)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.parametrize("with_mesh_group", [False, True])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"state_dtype": torch.int8},
        {"offload": True, "chunk_bytes": 1 << 16},
        {"offload": True, "chunk_bytes": 1 << 16, "state_dtype": torch.int8},
    ],
)
def test_mesh_steps_replay_equal_to_eager(mesh, kw, with_mesh_group):
    graphed, opt_g = _make(mesh, "auto", with_mesh_group, **kw)
    eager, opt_e = _make(mesh, False, with_mesh_group, **kw)
    assert opt_g._graphing.blocker is None
    steps, base = 7, [g["lr"] for g in opt_g.param_groups]
    for s in range(steps):
        for params, opt in ((graphed, opt_g), (eager, opt_e)):
            _grads(params, s)  # fresh gradients, new addresses, every step
            for g, lr in zip(opt.param_groups, base, strict=True):
                g["lr"] = lr * (1.0 - 0.05 * s)  # reaches the replay through the scalar table
            opt.step()
    torch.cuda.synchronize()
    stats = opt_g.graph_stats()
    assert stats["off"] is None, stats["off"]
    assert stats["captures"] == 1 and stats["replays"] == steps - 2, stats
    for a, b in zip(graphed, eager, strict=True):
        assert torch.equal(_local(a), _local(b))
        for key, value in opt_e.state[b].items():
            assert torch.equal(_local(opt_g.state[a][key]).cpu(), _local(value).cpu()), key
