"""dion's ``num_heads``: a 2-D weight of ``num_heads * head_dim`` rows orthogonalized head by
head, each head with the lr adjustment of its own shape (dion 0a059a4, ``_prepare_head_split``)."""

import pytest
import torch

from muon_offload import Muon

from reference64 import muon_step64, orthogonalize64_batch

# (shape, num_heads): wide heads (8 x 48), tall heads (16 x 12).
CASES = [((32, 48), 4), ((48, 12), 3)]
HYPER = dict(lr=0.02, mu=0.9, weight_decay=0.1)
# As test_math.py's UPDATE_RTOL (bf16 orthogonalization: measured 1.1% to 2.1% from float64);
# the whole-matrix update, the nearest wrong rule, is 29% to 47% away on these cases
# (ours: 1.1% to 2.5%).
UPDATE_RTOL = 3e-2
# dion's bf16 path rounds more (a bf16 norm, each term of the polynomial): measured 2.0% to
# 3.5% from float64 on these cases (CPU, torch 2.13), as test_vs_dion.py's 4% between the two.
DION_RTOL = 4e-2


def _rel(a, b, x0):
    return ((a.double() - b.double()).norm() / (b.double() - x0.double()).norm()).item()


def _grads(shape, steps, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(steps)]


def _run(cls, x0, num_heads, grads, **kwargs):
    p = torch.nn.Parameter(x0.clone())
    opt = cls([dict(params=[p], num_heads=num_heads)], **HYPER, **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _ref64(x0, num_heads, grads, heads=True, **kwargs):
    """float64, per head as dion defines it: the rows cut into consecutive heads."""
    view = (num_heads, x0.shape[0] // num_heads, x0.shape[1]) if heads else x0.shape
    x, m = x0.double().reshape(view), torch.zeros(view, dtype=torch.float64)
    for g in grads:
        x, m = muon_step64(
            x,
            g.reshape(view),
            m,
            lr=HYPER["lr"],
            mu=HYPER["mu"],
            wd=HYPER["weight_decay"],
            **kwargs,
        )
    return x.reshape(x0.shape)


@pytest.mark.parametrize("shape,num_heads", CASES)
@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm"])
def test_matches_float64_per_head(shape, num_heads, adjust_lr):
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    grads = _grads(shape, 3)
    got = _run(Muon, x0, num_heads, grads, adjust_lr=adjust_lr)
    ref_kw = dict(nesterov=False, adjust_lr=adjust_lr)
    want = _ref64(x0, num_heads, grads, **ref_kw)
    whole = _ref64(x0, num_heads, grads, heads=False, **ref_kw)
    assert _rel(got, want, x0) < UPDATE_RTOL
    assert _rel(whole, want, x0) > 5 * UPDATE_RTOL  # the bound tells heads from the whole


@pytest.mark.parametrize("shape,num_heads", CASES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_dion_and_ours_both_match_float64(shape, num_heads, nesterov):
    """Each judged against the float64 re-derivation (not one against the other's bf16
    rounding); with the same float64 orthogonalizer, the two agree to fp32 rounding."""
    dion = pytest.importorskip("dion")
    torch._dynamo.config.cache_size_limit = 64  # dion compiles per shape and setting
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    grads = _grads(shape, 3)
    kw = dict(nesterov=nesterov, adjust_lr="spectral_norm")
    want = _ref64(x0, num_heads, grads, **kw)
    ours = _run(Muon, x0, num_heads, grads, **kw)
    theirs = _run(dion.Muon, x0, num_heads, grads, **kw)
    assert _rel(ours, want, x0) < UPDATE_RTOL
    assert _rel(theirs, want, x0) < DION_RTOL
    exact = dict(kw, newton_schulz_func=orthogonalize64_batch)
    ours64 = _run(Muon, x0, num_heads, grads, **exact)
    theirs64 = _run(dion.Muon, x0, num_heads, grads, **exact)
    # Measured at most 7e-7 (CPU, torch 2.13); the heads' bf16 inputs are the same.
    assert _rel(ours64, theirs64, x0) < 1e-5


def _stack_run(params_2d, num_heads, backend, steps=2, device="cpu", **kwargs):
    """The step of 2-D parameters with ``num_heads`` and of the same values as 3-D stacks
    [heads, head_dim, cols] (dion's definition: the per-head view), side by side."""
    heads = [torch.nn.Parameter(x.clone().to(device)) for x in params_2d]
    stacks = [
        torch.nn.Parameter(x.clone().to(device).view(num_heads, -1, x.shape[1])) for x in params_2d
    ]
    a = Muon([dict(params=heads, num_heads=num_heads)], **HYPER, backend=backend, **kwargs)
    b = Muon([dict(params=stacks)], **HYPER, backend=backend, **kwargs)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        for h, s in zip(heads, stacks, strict=True):
            g = torch.randn(h.shape, generator=gen).to(device)
            h.grad, s.grad = g.clone(), g.clone().view(s.shape)
        a.step()
        b.step()
    return heads, stacks, a, b


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "kw", [{}, {"offload": True, "chunk_bytes": 4000}, {"resident_chunk_bytes": 4000}]
)
def test_heads_are_the_stack_of_heads_bitwise(backend, kw):
    """The 2-D parameter per head steps exactly as the 3-D stack of its heads (the Triton
    path too: its gradient table must read each head's rows), resident and offloaded,
    in one batch or several."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(32, 24, generator=gen) for _ in range(3)]
    heads, stacks, a, b = _stack_run(params, 4, backend, **kw)
    for h, s in zip(heads, stacks, strict=True):
        assert torch.equal(h.detach(), s.detach().view(h.shape))
        assert torch.equal(a.state[h]["momentum"], b.state[s]["momentum"].view(h.shape))


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"offload": True, "chunk_bytes": 1 << 20}])
def test_heads_are_the_stack_of_heads_bitwise_on_the_gpu(kw):
    """The Triton kernels on the GPU (the fused last product for local units), offloaded and
    resident, with heads of 128 x 512 as attention projections have."""
    gen = torch.Generator().manual_seed(8)
    params = [torch.randn(1024, 512, generator=gen) for _ in range(3)]
    heads, stacks, a, b = _stack_run(params, 8, "auto", steps=3, device="cuda", **kw)
    for h, s in zip(heads, stacks, strict=True):
        assert torch.equal(h.detach(), s.detach().view(h.shape))


def test_chunked_equals_unchunked_bitwise():
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(32, 24, generator=gen) for _ in range(4)]
    one, *_ = _stack_run(params, 4, "torch")
    for kw in ({"offload": True, "chunk_bytes": 4000}, {"resident_chunk_bytes": 4000}):
        cut, *_ = _stack_run(params, 4, "torch", **kw)
        for x, y in zip(one, cut, strict=True):
            assert torch.equal(x.detach(), y.detach())


@pytest.mark.parametrize(
    "group,match",
    [
        (dict(num_heads=5), "must divide dim 0"),
        (dict(num_heads=0), "positive int"),
        (dict(num_heads=True), "positive int"),
        (dict(num_heads=2.0), "positive int"),
        (dict(num_heads=4, flatten=True), "flatten"),
        (dict(num_heads=4, split_sizes=(16, 16)), "split_sizes"),
    ],
)
def test_bad_num_heads_refused_before_anything_is_touched(group, match):
    p = torch.nn.Parameter(torch.randn(32, 24))
    with pytest.raises(ValueError, match=match):
        Muon([dict(params=[p], **group)])
    # Set later: refused at step, the parameter and its state as they were.
    opt = Muon([dict(params=[p])], **HYPER)
    p.grad = torch.randn(32, 24)
    opt.step()
    before = p.detach().clone(), opt.state[p]["momentum"].clone()
    opt.param_groups[0].update(group)
    p.grad = torch.randn(32, 24)
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p.detach(), before[0])
    assert torch.equal(opt.state[p]["momentum"], before[1])
    assert opt.param_groups[0]["step"] == 1


def test_num_heads_of_a_stack_and_with_8bit_state_refused():
    stack = torch.nn.Parameter(torch.randn(2, 32, 24))
    with pytest.raises(ValueError, match="2-D parameter"):
        Muon([dict(params=[stack], num_heads=4)])
    p = torch.nn.Parameter(torch.randn(32, 24))
    with pytest.raises(NotImplementedError, match="int8"):
        Muon([dict(params=[p], num_heads=4)], state_dtype=torch.int8)


def test_num_heads_one_is_the_whole_matrix():
    x0 = torch.randn(32, 24, generator=torch.Generator().manual_seed(6))
    grads = _grads((32, 24), 2)
    p = torch.nn.Parameter(x0.clone())
    opt = Muon([dict(params=[p])], **HYPER)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert torch.equal(_run(Muon, x0, 1, grads), p.detach())
