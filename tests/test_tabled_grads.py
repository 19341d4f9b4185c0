"""Gradient matrices described (``TabledGrads``) where the step's gradient table serves them:
the prep launchers read the gradients through the table alone, so the engine hands them the
count, shape, dtype and alignment instead of a view a matrix. Runs the Triton kernels (under
the interpreter on the CPU): the steps equal those given the views, bit for bit, and the
alignment the description promises is the views' own."""

import pytest
import torch
from muon_offload.kernels import muon as muon_kernels
from muon_offload.kernels._grad_index import GradIndex, TabledGrads
from muon_offload.kernels._tables import all_aligned

from muon_offload import Muon
from muon_offload.optim import muon as muon_optim

# Stacks (two and three matrices), a 2-D weight; with bf16 gradients of odd sizes a matrix is
# not a multiple of 16 bytes long, so a stack's later matrices are misaligned.
SHAPES = ((3, 8, 16), (2, 5, 7), (24, 40), (4, 6, 10))
INT8_SHAPES = ((2, 64, 80), (3, 64, 80), (64, 80))


def _run(shapes, grad_dtype, described: bool, monkeypatch, seen, device="cpu", **kw):
    real = muon_optim._grad_matrices

    def spy(job, flatten, rows, ms):
        views = [g for grad in job.grads for g in muon_optim._matrices(grad, flatten, rows)]
        got = real(job, flatten, rows, ms)
        if isinstance(got, TabledGrads):  # what the views would have told the kernels
            assert got.aligned == all_aligned((views,))
            assert (got.count, got.shape, got.dtype) == (len(views), views[0].shape, views[0].dtype)
            seen.append(got)
        return got if described else views

    monkeypatch.setattr(muon_optim, "_grad_matrices", spy)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    for p in params:
        if hasattr(p, "grad_dtype"):  # torch >= 2.12 asks before a gradient of another dtype
            p.grad_dtype = None
    group = dict(params=params, **{k: kw.pop(k) for k in ("num_heads",) if k in kw})
    opt = Muon([group], lr=0.02, backend="triton", cuda_graph=False, **kw)
    for _ in range(3):
        for p in params:  # torch's default zero_grad(): a new tensor every step
            p.grad = torch.randn(p.shape, generator=gen).to(device, grad_dtype)
        opt.step()
        opt.zero_grad()
    return params, opt


@pytest.mark.parametrize(
    ("shapes", "kw"),
    [
        (SHAPES, {}),
        (SHAPES, {"offload": True, "chunk_bytes": 3000}),
        (SHAPES, {"nesterov": True, "state_dtype": torch.bfloat16}),
        (((24, 40), (10, 7)), {"num_heads": 2}),  # heads of 12 x 40 and 5 x 7
        (SHAPES, {"flatten": True}),
        (INT8_SHAPES, {"state_dtype": torch.int8}),
        (INT8_SHAPES, {"state_dtype": torch.int8, "offload": True, "chunk_bytes": 60_000}),
    ],
)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_described_gradients_step_as_their_views(monkeypatch, shapes, kw, grad_dtype, device):
    """On the GPU too: there the kernels compile for the alignment the description promises
    (misaligned bf16 stacks among them), where the interpreter ignores it."""
    seen = []
    described = _run(shapes, grad_dtype, True, monkeypatch, seen, device, **dict(kw))
    views = _run(shapes, grad_dtype, False, monkeypatch, [], device, **dict(kw))
    assert seen  # the stacks' preps took the description
    if grad_dtype == torch.bfloat16 and shapes is SHAPES and not kw.get("flatten"):
        assert not all(d.aligned for d in seen)  # (2, 5, 7): 70-byte matrices
    for (p, q), s in zip(zip(described[0], views[0], strict=True), described[0], strict=True):
        assert torch.equal(p, q)
        for k in described[1].state[s]:
            assert torch.equal(described[1].state[s][k], views[1].state[q][k]), k


def test_prep_launcher_takes_a_description_with_its_table():
    gen = torch.Generator().manual_seed(1)
    moms = [torch.randn(6, 10, generator=gen) for _ in range(3)]
    grads = [torch.randn(6, 10, generator=gen) for _ in range(3)]
    table = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64)
    index = GradIndex(table, (2, 0, 1))
    order = [grads[2], grads[0], grads[1]]
    described = TabledGrads(3, moms[0].shape, torch.float32, moms[0].device, True)
    a_m, b_m = [m.clone() for m in moms], [m.clone() for m in moms]
    a = muon_kernels.muon_prep(a_m, described, mu=0.9, nesterov=True, grad_index=index)
    b = muon_kernels.muon_prep(b_m, order, mu=0.9, nesterov=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(x, y) for x, y in zip(a_m, b_m, strict=True))
    with pytest.raises(ValueError, match="needs a grad_index"):
        muon_kernels.muon_prep(moms, described, mu=0.9, nesterov=False)
    wrong = TabledGrads(2, moms[0].shape, torch.float32, moms[0].device, True)
    with pytest.raises(ValueError, match="expected 3 of"):
        muon_kernels.muon_prep(moms, wrong, mu=0.9, nesterov=False, grad_index=index)
