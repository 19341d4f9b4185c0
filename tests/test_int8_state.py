"""8-bit state (``state_dtype=torch.int8``) through the engine: the same bits whatever the
chunking or offload, checkpoints that resume bitwise and convert to and from dense state, and
an update close to fp32 state's."""

import io

import pytest
import torch

from muon_offload import AdamW, Muon

# Odd sizes; 5000 and the matrices are quantized, the 40-vector stays dense (under 4096).
SHAPES = [(64, 96), (64, 96), (3, 32, 160), (5000,), (40,)]


def _run(state_dtype, offload, chunk_bytes=None, steps=3, start=0, params=None, opt=None, **extra):
    if params is None:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
        kw = dict(state_dtype=state_dtype, offload=offload, **extra)
        if chunk_bytes:
            kw["chunk_bytes"] = chunk_bytes
        groups = [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw")]
        opt = Muon(groups, lr=0.02, **kw)
    for s in range(start, start + steps):
        gen = torch.Generator().manual_seed(100 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def test_state_layout_and_dtypes():
    params, opt = _run(torch.int8, False)
    assert set(opt.state[params[0]]) == {"momentum_codes", "momentum_scales"}
    assert opt.state[params[2]]["momentum_scales"].shape == (3, 20)  # per matrix: 5120 / 256
    assert opt.state[params[3]]["variance_codes"].dtype == torch.uint8
    assert set(opt.state[params[4]]) == {"momentum", "variance"}  # small: dense fp32
    assert opt.state[params[4]]["momentum"].dtype == torch.float32


def test_chunking_and_offload_give_the_same_bits():
    ref, _ = _run(torch.int8, False)
    for kw in (dict(offload=True), dict(offload=True, chunk_bytes=3000)):
        got, _ = _run(torch.int8, **kw)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


@pytest.mark.parametrize("state_dtype", [torch.int8, torch.bfloat16])
@pytest.mark.parametrize("offload", [True, False])
def test_muon_chunks_hold_the_matrices_of_fp32_state(state_dtype, offload):
    """A Muon chunk's work buffers grow with its matrices, so narrower state must not pack more
    matrices into a chunk than fp32 state does (8-bit packed 4 x, and the step's GPU memory
    grew to match); element-wise state still counts its own bytes."""
    budget = 64 * 96 * 4  # one (64, 96) matrix of fp32 momentum
    kw = dict(chunk_bytes=budget, resident_chunk_bytes=budget)

    def muon_chunks(dtype):
        params, opt = _run(dtype, offload, steps=1, **kw)
        plan = next(iter(opt._plans.values()))[0]
        muon = [[u.params for u in c.units if u.algorithm == "muon"] for c in plan.chunks]
        return [m for m in muon if m]

    assert muon_chunks(state_dtype) == muon_chunks(torch.float32)


def test_close_to_fp32_state():
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    q, _ = _run(torch.int8, False)
    f, _ = _run(None, False)
    # The 3-step update with 8-bit state against fp32 state's, relative to its size: measured
    # 0.8% (AdamW) to 1.3% (Muon) on the CPU; a wrong map or scale is off by tens of percent.
    for a, b, x in zip(q, f, init, strict=True):
        assert ((a - b).norm() / (b - x).norm()) < 3e-2


def test_resume_is_bitwise_and_converts():
    params, opt = _run(torch.int8, True, chunk_bytes=3000)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    twins, twin_opt = _run(torch.int8, True, chunk_bytes=3000, steps=0)
    for t, p in zip(twins, params, strict=True):
        t.data.copy_(p)
    twin_opt.load_state_dict(saved)
    _run(None, None, steps=2, start=3, params=params, opt=opt)
    _run(None, None, steps=2, start=3, params=twins, opt=twin_opt)
    assert all(torch.equal(a, b) for a, b in zip(params, twins, strict=True))
    # 8-bit into a dense optimizer and dense into an 8-bit one.
    _, dense = _run(None, False, steps=0)
    dense.load_state_dict(saved)
    m = dense.state[dense.param_groups[0]["params"][0]]["momentum"]
    assert m.dtype == torch.float32 and m.abs().sum() > 0
    _, back = _run(torch.int8, False, steps=0)
    back.load_state_dict(dense.state_dict())


def test_adamw_int8_and_bad_input():
    p = torch.nn.Parameter(torch.randn(4099))
    opt = AdamW([p], state_dtype=torch.int8)
    p.grad = torch.randn(4099)
    opt.step()
    assert opt.state[p]["exp_avg_codes"].dtype == torch.int8
    with pytest.raises(ValueError, match="state_dtype"):
        AdamW([p], state_dtype=torch.float16)


# ------------------------------------------- a failed 8-bit load changes nothing, steps still


def _stack_opt(flatten, state_dtype=torch.int8, seed=0):
    """A 3-D stack (8-bit scales one row a matrix unless ``flatten``) and an AdamW vector."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((3, 32, 160), (5000,))]
    groups = [dict(params=params[:1], flatten=flatten), dict(params=params[1:], algorithm="adamw")]
    opt = Muon(groups, lr=0.02, state_dtype=state_dtype)
    _run(None, None, steps=1, params=params, opt=opt)
    return params, opt


def _saved(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _assert_load_fails_and_changes_nothing(params, opt, bad):
    before = _saved(opt.state_dict())
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert [{k: v for k, v in g.items() if k != "params"} for g in after["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in before["param_groups"]
    ]
    assert after["state"].keys() == before["state"].keys()
    for i, values in before["state"].items():
        assert after["state"][i].keys() == values.keys()
        for key, value in values.items():
            assert torch.equal(after["state"][i][key], value), (i, key)
    _run(None, None, steps=1, start=5, params=params, opt=opt)  # and it still steps


def _edited(opt, fn):
    sd = _saved(opt.state_dict())
    fn(sd["state"])
    return sd


@pytest.mark.parametrize("state_dtype", [torch.int8, None])
def test_a_failed_load_of_8bit_state_changes_nothing(state_dtype):
    """Scales of another layout (a stack saved with flatten=False loaded where flatten=True has
    made its state), truncated scales, codes of the other kind: refused before anything is
    written, into 8-bit state and (decoded) into dense state."""
    _, saved_opt = _stack_opt(flatten=False)
    unflattened = _saved(saved_opt.state_dict())
    params, opt = _stack_opt(flatten=True, state_dtype=state_dtype)
    cases = {
        "another layout": unflattened,
        "truncated scales": _edited(
            saved_opt, lambda s: s[0].update(momentum_scales=s[0]["momentum_scales"][:, :-1])
        ),
        "truncated vector scales": _edited(
            saved_opt, lambda s: s[1].update(variance_scales=s[1]["variance_scales"][:-1])
        ),
        "variance codes signed": _edited(
            saved_opt, lambda s: s[1].update(variance_codes=s[1]["variance_codes"].to(torch.int8))
        ),
    }
    if state_dtype is None:  # decoded into dense state: either self-consistent layout loads
        del cases["another layout"]
    for name, bad in cases.items():
        _assert_load_fails_and_changes_nothing(params, opt, bad)
        assert name  # for the traceback


def test_an_8bit_checkpoint_of_another_layout_loads_into_fresh_or_dense_state():
    """What does fit still loads: into an optimizer without state yet (its group takes the
    saved flatten, and its state that layout), and decoded into dense state."""
    _, saved_opt = _stack_opt(flatten=False)
    saved = _saved(saved_opt.state_dict())
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((3, 32, 160), (5000,))]
    groups = [dict(params=params[:1], flatten=True), dict(params=params[1:], algorithm="adamw")]
    fresh = Muon(groups, lr=0.02, state_dtype=torch.int8)
    fresh.load_state_dict(saved)
    assert fresh.state[params[0]]["momentum_scales"].shape == (3, 20)
    _run(None, None, steps=1, params=params, opt=fresh)
    dense_params, dense = _stack_opt(flatten=False, state_dtype=None)
    dense.load_state_dict(saved)
    _run(None, None, steps=1, params=dense_params, opt=dense)
