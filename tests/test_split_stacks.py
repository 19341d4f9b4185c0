"""Parameters with more state than a chunk are cut: a Muon stack between its matrices, an
element-wise parameter on block boundaries. Whatever the cut, a step is bitwise the resident,
unchunked one, and the state is still one entry a parameter (``state_dict``)."""

import functools

import pytest
import torch
from _mixed_runs import assert_bitwise, mixed_run

from muon_offload import Muon, StepInterrupted

# Muon: a stack of 7 matrices of 33 x 65 (8,580 bytes of fp32 momentum each), a 4-D stack of
# 6, a matrix; AdamW: a vector of 4,099 (over 4,096: 8-bit state) and a 70 x 90 matrix; Lion.
SHAPES = [(7, 33, 65), (2, 3, 9, 10), (33, 65), (4099,), (70, 90), (300,)]
MUON, ADAMW = 3, 2
STACK_BYTES = 4 * 7 * 33 * 65
# 3,000: every matrix of the stack alone (over budget) and 8-bit AdamW state cut; 20,000: the
# stack in pieces of two matrices, fp32 AdamW state cut; 1 GiB: nothing cut.
CHUNKS = [3_000, 20_000, 1 << 30]


def _init(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _run(state_dtype, steps=3, **kwargs):
    return mixed_run(_init(), MUON, ADAMW, 40, steps=steps, state_dtype=state_dtype, **kwargs)


@functools.cache
def _shared_run(state_dtype, **kwargs):
    """``_run`` for the runs that several cases compare (the resident one against each chunk
    size, the offloaded ones against each other): made once a module, then only read."""
    return _run(state_dtype, **kwargs)


def _stack_pieces(opt):
    """The matrix ranges the last step's plan cut the (7, 33, 65) stack (parameter 0) into."""
    plan = opt._plans.last[1][0]
    return [
        (0, 7) if u.piece(k) is None else (u.piece(k).start, u.piece(k).stop)
        for u in plan.units()
        if hasattr(u, "pieces")
        for k, i in enumerate(u.params)
        if i == 0
    ]


def _assert_same_state_dicts(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i, values in sa["state"].items():
        assert values.keys() == sb["state"][i].keys()
        for key, t in values.items():
            other = sb["state"][i][key]
            if isinstance(t, torch.Tensor):
                assert t.dtype == other.dtype and torch.equal(t, other), (i, key)
            else:
                assert t == other, (i, key)


@pytest.mark.parametrize("state_dtype", [None, torch.int8])
@pytest.mark.parametrize("chunk_bytes", CHUNKS)
def test_cut_parameters_step_bitwise_as_resident(state_dtype, chunk_bytes):
    resident = _shared_run(state_dtype)
    offloaded = _shared_run(state_dtype, offload=True, chunk_bytes=chunk_bytes)
    assert_bitwise(offloaded, resident)
    _assert_same_state_dicts(offloaded[1], resident[1])
    # The stack is cut only when over budget, at matrix boundaries, in order, each matrix
    # once, each piece within budget unless a matrix alone is not.
    pieces = _stack_pieces(offloaded[1])
    assert [start for start, _ in pieces] == [0] + [stop for _, stop in pieces[:-1]]
    assert pieces[-1][1] == 7
    assert (len(pieces) > 1) == (chunk_bytes < STACK_BYTES)
    fits = max(1, chunk_bytes // (STACK_BYTES // 7))
    assert all(stop - start <= fits for start, stop in pieces)


@pytest.mark.parametrize("state_dtype", [None, torch.int8])
def test_cut_chunks_equal_one_huge_chunk_bitwise(state_dtype):
    """Offloaded both: the stack cut in four (20,000) against everything in one chunk."""
    cut = _shared_run(state_dtype, offload=True, chunk_bytes=20_000)
    whole = _shared_run(state_dtype, offload=True, chunk_bytes=1 << 30)
    assert _stack_pieces(cut[1]) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert _stack_pieces(whole[1]) == [(0, 7)]
    assert_bitwise(cut, whole)


@pytest.mark.parametrize("state_dtype", [None, torch.int8])
def test_state_dict_of_a_cut_run_loads_into_any_chunking(state_dtype):
    """A checkpoint of a cut run is per parameter: loaded into a resident optimizer (and a
    resident one's into a cut one), the next steps are bitwise those of the run that never
    stopped."""
    cut = _run(state_dtype, steps=2, offload=True, chunk_bytes=3_000)
    resident = _run(state_dtype, steps=2)
    expected = _shared_run(state_dtype)  # the run that never stopped, three steps
    for source, target_kwargs in ((cut, {}), (resident, dict(offload=True, chunk_bytes=3_000))):
        params = [torch.nn.Parameter(p.detach().clone()) for p in source[0]]
        groups = [
            dict(params=params[:MUON]),
            dict(params=params[MUON : MUON + ADAMW], algorithm="adamw"),
            dict(params=params[MUON + ADAMW :], algorithm="lion"),
        ]
        opt = Muon(groups, lr=0.02, weight_decay=0.05, state_dtype=state_dtype, **target_kwargs)
        opt.load_state_dict(source[1].state_dict())
        gen = torch.Generator().manual_seed(40 + 2)  # the third step's gradients (mixed_run)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        assert_bitwise((params, opt), expected)


def test_cut_stack_through_the_kernels_equals_resident_bitwise():
    """The Triton kernels (interpreted here): a cut stack's pieces read their gradients
    through the step's gradient table at their matrices' offsets."""
    kernels = dict(backend="triton", steps=2)
    resident = _run(None, **kernels)
    cut = _run(None, offload=True, chunk_bytes=20_000, **kernels)
    assert _stack_pieces(cut[1]) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert cut[1]._grad_table is not None and cut[1]._grad_table.misaligned is not None
    assert_bitwise(cut, resident)


def test_step_stopped_between_a_stacks_pieces_names_it_partial(monkeypatch):
    """A step stopped (in an AdamW or Lion chunk, run between the Muon ones) after the first
    piece of a cut stack: those matrices keep their update, the rest their weights as before,
    and the stack is named as updated in part."""
    params, opt = _run(None, steps=1, offload=True, chunk_bytes=20_000)
    before = params[0].detach().clone()
    pieces = []
    for name, algorithm in opt.algorithms.items():

        def update(job, algorithm=algorithm, muon=name == "muon"):
            if muon:
                pieces.append(job.params[0].shape)
            elif pieces:
                raise RuntimeError("stop")
            return type(algorithm).update(algorithm, job)

        monkeypatch.setattr(algorithm, "update", update)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(StepInterrupted) as info:
        opt.step()
    assert pieces == [(2, 33, 65)]  # the stack's first piece, then the AdamW / Lion chunk
    assert any(p is params[0] for p in info.value.partial), str(info.value)
    assert "cut across chunks" in str(info.value)
    assert not torch.equal(params[0][:2], before[:2])
    assert torch.equal(params[0][2:], before[2:])
