"""Parameters that are not contiguous (a transposed view, a slice of a larger tensor): updated
in place, as torch's optimizers update them, through a contiguous copy written back."""

import pytest
import torch

from muon_offload import AdamW, Muon

from reference64 import muon_step64

# torch.optim.AdamW's single-tensor path and ours do the same fp32 operations in the same order
# (test_vs_torch_adamw.py): bitwise on the torch path; the Triton kernel orders them otherwise.
RTOL, ATOL = 1e-5, 1e-6
# test_math.py's bound for one Muon update against float64 (bf16 orthogonalization).
UPDATE_RTOL = 3e-2
LAYOUTS = ["transposed", "sliced"]
MODES = [{}, {"offload": True, "chunk_bytes": 1024}]


def _param(layout, seed):
    """A (24, 40) parameter that is not contiguous, and the tensor whose storage it views."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "transposed":
        base = torch.randn(40, 24, generator=gen)
        view = base.t()
    else:
        base = torch.randn(24, 56, generator=gen)
        view = base[:, 8:48]
    p = torch.nn.Parameter(view)
    assert not p.is_contiguous() and p.data_ptr() == view.data_ptr()
    return p, base


def _grads(steps, seed=11):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(24, 40, generator=gen) for _ in range(steps)]


def _step_all(opt, params, grads):
    for g in grads:
        for p in params:
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kw", MODES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_adamw_matches_torch_in_place(layout, kw, backend):
    p, base = _param(layout, 0)
    ref = torch.nn.Parameter(p.detach().clone())
    ptr, stride = p.data_ptr(), p.stride()
    grads = _grads(3)
    ours = AdamW([p], lr=1e-2, weight_decay=0.1, backend=backend, **kw)
    theirs = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    _step_all(ours, [p], grads)
    _step_all(theirs, [ref], grads)
    assert (p.data_ptr(), p.stride()) == (ptr, stride)  # updated where it is
    if backend == "torch":
        assert torch.equal(p.detach(), ref.detach())
    else:
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=RTOL, atol=ATOL)
    exp_avg = theirs.state[ref]["exp_avg"]
    torch.testing.assert_close(ours.state[p]["exp_avg"], exp_avg, rtol=RTOL, atol=ATOL)
    # What the view does not cover is untouched.
    if layout == "sliced":
        x0 = _param(layout, 0)[1]
        assert torch.equal(base[:, :8], x0[:, :8]) and torch.equal(base[:, 48:], x0[:, 48:])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kw", MODES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_muon_matches_a_contiguous_twin_and_float64(layout, kw, backend):
    """A Muon matrix and an adamw matrix, each not contiguous, beside contiguous twins: the
    same bits; the Muon one within test_math.py's bound of the float64 update."""
    p, _ = _param(layout, 1)
    q, _ = _param(layout, 2)
    twins = [torch.nn.Parameter(t.detach().clone()) for t in (p, q)]
    x0 = p.detach().clone()
    grads = _grads(2)
    hyper = dict(lr=0.02, mu=0.9, weight_decay=0.1, backend=backend, **kw)
    ours = Muon([dict(params=[p]), dict(params=[q], algorithm="adamw")], **hyper)
    plain = Muon([dict(params=twins[:1]), dict(params=twins[1:], algorithm="adamw")], **hyper)
    _step_all(ours, [p, q], grads)
    _step_all(plain, twins, grads)
    assert not p.is_contiguous() and not q.is_contiguous()
    assert torch.equal(p.detach(), twins[0].detach())
    assert torch.equal(q.detach(), twins[1].detach())
    x, m = x0.double(), torch.zeros(24, 40, dtype=torch.float64)
    for g in grads:
        x, m = muon_step64(
            x, g, m, lr=0.02, mu=0.9, wd=0.1, nesterov=False, adjust_lr="spectral_norm"
        )
    rel = (p.detach().double() - x).norm() / (x - x0.double()).norm()
    assert rel < UPDATE_RTOL


@pytest.mark.cuda
@pytest.mark.parametrize("kw", MODES)
def test_on_the_gpu_equals_a_contiguous_twin_and_stays_eager(kw):
    gen = torch.Generator().manual_seed(9)
    base = [torch.randn(512, 256, generator=gen).cuda() for _ in range(2)]
    ours = [torch.nn.Parameter(t.t()) for t in base]  # 256 x 512, transposed
    twins = [torch.nn.Parameter(p.detach().contiguous()) for p in ours]
    hyper = dict(lr=0.02, weight_decay=0.1, **kw)

    def groups(ps):
        return [dict(params=ps[:1]), dict(params=ps[1:], algorithm="adamw")]

    a, b = Muon(groups(ours), **hyper), Muon(groups(twins), **hyper)
    for _ in range(6):  # past the steps after which a graph would be captured
        for p, q in zip(ours, twins, strict=True):
            g = torch.randn(p.shape, generator=gen).cuda()
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, twins, strict=True):
        assert not p.is_contiguous() and torch.equal(p.detach(), q.detach())
    assert a.graph_stats()["captures"] == 0
