"""State dropped between steps (``del opt.state[p]``, a new ``opt.state``) is made afresh in the
host bytes it left, wherever the parameters dropped lie in the slabs.

The planner spreads element-wise chunks among the matrix ones (``planner._interleave``), so a
large AdamW tensor's bytes lie between Muon chunks. The state of the parameters dropped is
created in the order of a plan of those parameters alone: placed first-fit, a Muon matrix took
the bytes an AdamW tensor had left, and that tensor went to a new slab (on the H200, with this
model at full size: 109075968 -> 117464576 host bytes, cuda_graph or not). On a GPU:
test_gpu_engine.py::test_dropped_state_reuses_its_pinned_bytes_bitwise."""

from collections import defaultdict

import torch
from _graph_emulator import RecordingGraph

from muon_offload import Muon
from muon_offload.engine import capture_rules
from muon_offload.engine.graphs import StepGraphs
from muon_offload.engine.host_slabs import HostSlabs

# test_gpu_engine's race model, 1/256 of its state: chunks of 8 matrices, AdamW tensors of 4
# chunks' bytes each between them.
SHAPES = [(8, 32)] * 24 + [(32, 8)] * 8 + [(8192,)] * 6 + [(301,)]
BUDGET = dict(chunk_bytes=8192, resident_chunk_bytes=8192, backend="torch")


def _run(init, **kwargs):
    params = [torch.nn.Parameter(t.clone()) for t in init]
    groups = [dict(params=params[:32]), dict(params=params[32:], algorithm="adamw")]
    opt = Muon(groups, lr=0.01, **BUDGET, **kwargs)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def _addresses(opt, params):
    return [[t.data_ptr() for t in opt.state[p].values()] for p in params]


def test_dropped_state_goes_back_into_its_own_bytes():
    """All of it, then every third parameter's (Muon matrices and AdamW tensors), four times:
    the host bytes stay flat, every tensor is made where it was, and the steps equal those of
    resident state dropped the same way, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    runs = []
    for kwargs in (dict(offload=True), {}):
        params, opt = _run(init, **kwargs)
        held, where = opt.host_state_bytes, _addresses(opt, params)
        gen = torch.Generator().manual_seed(8)
        for s in range(4):
            if s % 2 == 0:
                opt.state = defaultdict(dict)
            else:
                for p in params[::3]:
                    del opt.state[p]
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            assert opt.host_state_bytes == held, s
            if kwargs:
                assert _addresses(opt, params) == where, s
        runs.append((params, opt))
    (offloaded, o_opt), (resident, r_opt) = runs
    assert o_opt.host_state_bytes > 0 and len(o_opt._store.streamed) == len(SHAPES)
    for a, b in zip(offloaded, resident, strict=True):
        assert torch.equal(a, b)
        for key in o_opt.state[a]:
            assert torch.equal(o_opt.state[a][key], r_opt.state[b][key])


def test_host_slabs_place_an_owner_back_where_it_was():
    """A small tensor asked for before a large one whose bytes lie before its own: first-fit
    put it in the large one's bytes, and the large one in a new slab."""
    slabs = HostSlabs(pin=False)
    f32 = torch.float32
    specs = [((64,), f32), ((1024,), f32), ((64,), f32), ((64,), f32), ((64,), f32)]
    owners = ["kept", "large", "kept2", "small", "kept3"]
    first = slabs.allocate(specs, owners)
    where = {o: t.data_ptr() for o, t in zip(owners, first, strict=True)}
    for t in first:
        t.fill_(5)
    kept = [first[0], first[2], first[4]]
    del first, t
    held = slabs.nbytes
    again = slabs.allocate([specs[3], specs[1]], ["small", "large"])  # the small one first
    assert slabs.nbytes == held and len(slabs.slabs) == 1
    assert [t.data_ptr() for t in again] == [where["small"], where["large"]]
    assert all(not t.any() for t in again) and all(bool((t == 5).all()) for t in kept)
    # An owner whose bytes are still held elsewhere goes to free bytes, as one without a home.
    moved = slabs.allocate([specs[0]], ["kept"])
    assert moved[0].data_ptr() != where["kept"] and bool((kept[0] == 5).all())


def test_state_dropped_under_a_captured_graph(monkeypatch):
    """Dropped while a graph replays (a stand-in that does what a CUDA graph does,
    tests/_graph_emulator.py): made afresh in the same bytes, so the graph's key sees the same
    state addresses, but not the same plan: the graph is dropped, never replayed onto the new
    state, and the steps equal an eager twin's bit for bit."""
    monkeypatch.setattr(capture_rules, "check_device", lambda cuda_graph, device: None)
    made, pair = [], []
    for graphed in (True, False):
        gen = torch.Generator().manual_seed(0)
        shapes = ((24, 40), (24, 40), (40, 24), (300,), (5,))
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        groups = [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw")]
        opt = Muon(groups, lr=0.02, backend="triton", offload=True, chunk_bytes=6000)
        opt.cuda_graph = graphed
        if graphed:
            opt._graphing.graphs = StepGraphs(
                torch.device("cpu"), lambda: made.append(RecordingGraph()) or made[-1]
            )
        pair.append((opt, params))
    held = None
    for s in range(7):
        for opt, params in pair:
            if s == 3:
                for p in params[::2]:
                    del opt.state[p]
            gen = torch.Generator().manual_seed(100 + s)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        (opt_a, a), (opt_b, b) = pair
        if s == 2:
            held, where = opt_a.host_state_bytes, _addresses(opt_a, a)
            assert made and made[0].replays == 2  # captured at step 1, replayed at 1 and 2
        elif s > 2:
            assert opt_a.host_state_bytes == held and _addresses(opt_a, a) == where
    assert made[0].was_reset and made[0].replays == 2
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        for key in opt_a.state[p]:
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key]), key
