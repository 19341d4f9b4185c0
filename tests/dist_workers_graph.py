"""Worker bodies for tests/test_graph_mesh.py: each runs in its own process (gloo, CPU) and
raises on a failed check, which fails the spawning test."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from muon_offload import Muon
from muon_offload.distributed import local
from muon_offload.engine import capture_rules, graphs

import dist_workers
from dist_workers import _finish, build, init, set_grads


def _refused(groups, mesh, match):
    with pytest.raises(NotImplementedError, match=match):
        Muon(groups, distributed_mesh=mesh, lr=0.02, backend="triton", cuda_graph=True)


def rule_decisions(rank, world, port):
    """gloo meshes (and DTensors on them) stay eager with the reason ("auto") or are refused
    (True); a mesh whose CUDA collectives run through NCCL passes the rule (faked here: the
    backend config read as "cuda:nccl"), so that only the device check is left to refuse."""
    mesh = init(rank, world, port)
    params, groups = build(mesh, True)
    opt = Muon(groups, distributed_mesh=mesh, lr=0.02)
    assert opt._graphing.blocker == (
        "a distributed_mesh whose CUDA collectives run through gloo (not NCCL)"
    ), opt._graphing.blocker
    # A DTensor group without a distributed_mesh (AdamW: no collective of the optimizer's),
    # on the gloo mesh: still blocked, by its parameters' mesh.
    dt = [p for p in params if isinstance(p, DTensor)][-1:]
    assert capture_rules.group_blocker(dict(params=dt), None) == (
        "DTensor parameters on a mesh whose CUDA collectives run through gloo (not NCCL)"
    )
    _refused(
        groups, mesh, "cannot capture a distributed_mesh whose CUDA collectives run through gloo"
    )
    real = capture_rules.cuda_backend
    capture_rules.cuda_backend = lambda group: "nccl"
    try:
        # "auto" leaves collectives across processes eager; cuda_graph=True captures them.
        across = capture_rules.group_blocker(dict(params=dt), mesh.get_group(), True)
        assert across is None
        params, groups = build(mesh, True)
        auto = Muon(groups, distributed_mesh=mesh, lr=0.02)._graphing.blocker
        assert auto == (
            f"a distributed_mesh of {world} processes (cuda_graph=True captures their collectives)"
        ), auto
        assert capture_rules.group_blocker(dict(params=dt), None) == (
            f"DTensor parameters on a mesh of {world} processes (cuda_graph=True captures "
            "their collectives)"
        )
        with pytest.raises(ValueError, match="needs parameters on a CUDA device"):
            Muon(groups, distributed_mesh=mesh, lr=0.02, backend="triton", cuda_graph=True)
    finally:
        capture_rules.cuda_backend = real
    # The backend config itself, as torch writes it.
    assert real(mesh.get_group()) == "gloo"
    _finish()


def dtensor_key(rank, world, port):
    """A step with DTensor parameters gets a gradient table and a graph key made of the
    shards' addresses (a DTensor's own data_ptr() is 0): equal at the next step, other when
    a shard moves."""
    mesh = init(rank, world, port)
    params, groups = build(mesh, True)
    opt = Muon(groups, distributed_mesh=mesh, lr=0.02, backend="triton", cuda_graph=False)
    keys = []
    real = graphs.step_key

    def spy(*args, **kwargs):
        keys.append(real(*args, **kwargs))
        return keys[-1]

    class RunsAtCapture:  # a graph whose capture runs the step once, eagerly
        def capture(self, body):
            body()

        def replay(self):
            pass

        def reset(self):
            pass

    graphs.step_key = spy
    opt._graphing.graphs = graphs.StepGraphs(torch.device("cpu"), new_graph=RunsAtCapture)
    opt.cuda_graph = "auto"
    opt._graphing.blocker = None  # the gloo mesh stands in for NCCL's
    auto = capture_rules.auto_blocker
    capture_rules.auto_blocker = lambda device, backend, algorithms: None  # the CPU for CUDA
    try:
        for s in range(3):
            set_grads(params, s, mesh)  # fresh gradients every step
            if s == 2:
                moved = params[0]
                moved._local_tensor = local(moved).clone()  # a shard at a new address
            opt.step()
    finally:
        graphs.step_key, capture_rules.auto_blocker = real, auto
    (k0, why0), (k1, _), (k2, _) = keys
    assert k0 is not None, why0
    assert k0 == k1, graphs.changed(k0, k1)
    assert 0 not in k0.params[0] and local(params[1]).data_ptr() in k0.params[0]
    state_ptrs = {local(t).data_ptr() for p in params for t in opt.state[p].values()}
    assert set(k0.state) <= state_ptrs and 0 not in k0.state
    assert graphs.changed(k1, k2) == graphs.WHAT["params"]
    assert opt.graph_stats()["captures"] == 1  # at step 1, the key of step 0 holding
    _finish()


def replay_equals_eager(rank, world, port):
    """Sharded (all-to-all) and replicated (all-gather) Muon over a gloo mesh, with a stand-in
    graph that records the step's launches and collectives and replays them
    (tests/_graph_emulator.py), against an eager twin: equal bits over several steps with
    fresh gradients. The last rank's key changes at step 2 (a shard moved), so it runs that
    step eagerly and captures at step 3 while the others replay: the collectives stay paired
    (a capture runs none; its replay right after runs them all, in order)."""
    from _graph_emulator import RecordingGraph

    mesh = init(rank, world, port)
    auto = capture_rules.auto_blocker
    capture_rules.auto_blocker = lambda device, backend, algorithms: None  # the CPU for CUDA
    pair = []
    for graphed in (True, False):
        params, groups = build(mesh, True)
        opt = Muon(groups, distributed_mesh=mesh, lr=0.02, backend="triton", cuda_graph=False)
        if graphed:
            opt._graphing.graphs = graphs.StepGraphs(torch.device("cpu"), new_graph=RecordingGraph)
            opt.cuda_graph, opt._graphing.blocker = "auto", None  # gloo stands in for NCCL
        pair.append((params, opt))
    last = rank == world - 1
    try:
        for s in range(5):  # 4: every rank replays, the last on the graph it captured at 3
            for params, opt in pair:
                set_grads(params, s, mesh)  # new gradient tensors every step
                if s == 2 and last and opt is pair[0][1]:
                    params[0]._local_tensor = local(params[0]).clone()  # same values, moved
                opt.param_groups[0]["lr"] *= 0.9  # read from the scalar table
                opt.step()
    finally:
        capture_rules.auto_blocker = auto
    stats = pair[0][1].graph_stats()
    # 0 eager, 1 capture, 2-4 replay; the last rank: 2 eager (moved), 3 capture, 4 replay.
    expected = (2, 1, 2) if last else (1, 3, 1)
    assert (stats["captures"], stats["replays"], stats["eager_steps"]) == expected, stats
    _assert_pair_equal(pair)
    _finish()


def table_against_own_addresses(rank, world, port):
    """DTensor steps read their gradients through the gradient table (the shards' rows, a
    shard's heads under ``num_heads``): bit for bit the steps whose launchers read the
    gradients' own addresses (no table, as before DTensors had one)."""
    from muon_offload.engine.grad_table import GradTable

    mesh = init(rank, world, port)
    write = GradTable.write
    pair = []
    for _ in range(2):
        params, groups = build(mesh, True)
        gen = torch.Generator().manual_seed(6)
        for shape in ((32, 24), (48, 16)):  # heads of 8 and 12 rows, whole on every rank
            t = torch.randn(shape, generator=gen)
            params.append(torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])))
        groups.append(dict(params=params[-2:], num_heads=4))
        pair.append((params, Muon(groups, distributed_mesh=mesh, lr=0.02, backend="triton")))
    rows = []
    try:
        for s in range(2):  # 1: the table written again, for new gradients, over state
            for (params, opt), table in zip(pair, (True, False), strict=True):
                GradTable.write = write if table else (lambda self, *args: None)
                set_grads(params, s, mesh)
                opt.step()
                rows.append(opt._grad_table.key())
    finally:
        GradTable.write = write
    assert all(r is not None for r in rows[::2]) and all(r is None for r in rows[1::2])
    _assert_pair_equal(pair)
    _finish()


def _assert_pair_equal(pair) -> None:
    """Two (params, opt) runs: the same local weights and state, bit for bit."""
    (a, opt_a), (b, opt_b) = pair
    for p, q in zip(a, b, strict=True):
        assert torch.equal(local(p), local(q))
        for key, value in opt_b.state[q].items():
            assert torch.equal(local(opt_a.state[p][key]), local(value)), key


assert dist_workers  # the module's BACKEND and DEVICE are the ones init() sets
