"""8-bit state: the code maps, the fused kernels against their torch references, the
references against a float64 re-derivation, and a long run against fp32 AdamW state."""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_utils import DEVICES, INTERPRETED, bf16_ulp, randn
from muon_offload.kernels import quant_maps
from muon_offload.kernels import quantized_elementwise as ew8
from muon_offload.kernels import quantized_elementwise_reference as ref8
from muon_offload.kernels import quantized_muon as muon8
from muon_offload.kernels.elementwise_reference import adamw_reference_

# Odd sizes: a partial last block (4097 = 16 blocks + 1, 63 < one block), one exact block,
# several programs under the interpreter's 1024-element chunks.
SIZES = [4097, 63, 256, 1500]
F32, BF16 = torch.float32, torch.bfloat16
ADAMW = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LION = dict(lr=3e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)


def _state(kind, n, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))
    if kind == "adam_v":
        x = x.square()
    codes, scales = quant_maps.quantize(x, kind)
    return codes.to(device), scales.to(device)


def _bracket64(x: torch.Tensor, kind: str):
    """The two code values (float64) around each element of x: any rounding gives one."""
    cmap = quant_maps.MAPS[kind]
    flat = x.double().reshape(-1)
    pad = -flat.numel() % quant_maps.QBLOCK
    xb = torch.nn.functional.pad(flat, (0, pad)).view(-1, quant_maps.QBLOCK)
    amax = xb.abs().amax(1, keepdim=True)
    y = xb.abs() / amax.clamp_min(1e-300)
    c = torch.floor(y ** (1 / cmap.power) * cmap.cmax + 1e-9).clamp(max=cmap.cmax)
    lo = (c / cmap.cmax) ** cmap.power * amax
    hi = ((c + 1).clamp(max=cmap.cmax) / cmap.cmax) ** cmap.power * amax
    if not cmap.signed:  # a positive v never encodes as 0
        lo = torch.where(xb > 0, torch.maximum(lo, amax / cmap.cmax**cmap.power), lo)
    n = x.numel()
    return lo.reshape(-1)[:n], hi.reshape(-1)[:n]


def _assert_within_step(deq: torch.Tensor, exact: torch.Tensor, kind: str) -> None:
    """|deq| lies between the codes around |exact| (float64), up to fp32 rounding."""
    lo, hi = _bracket64(exact, kind)
    mag = deq.double().abs().reshape(-1)
    slack = 1e-6 * hi + 1e-30
    assert ((mag >= lo - slack) & (mag <= hi + slack)).all()
    same_sign = (deq.reshape(-1).sign() == exact.reshape(-1).sign()) | (mag == 0)
    assert same_sign.all()


@pytest.mark.parametrize("kind", ["momentum", "adam_m", "adam_v"])
def test_quantize_round_trip_within_one_code_step(kind):
    x = randn(4097, F32, "cpu") * torch.exp(randn(4097, F32, "cpu"))
    if kind == "adam_v":
        x = x.square()
    codes, scales = quant_maps.quantize(x, kind)
    assert codes.dtype == quant_maps.CODE_DTYPES[kind] and codes.shape == x.shape
    assert scales.dtype == F32 and scales.shape == (math.ceil(4097 / quant_maps.QBLOCK),)
    deq = quant_maps.dequantize(codes, scales, kind)
    _assert_within_step(deq, x, kind)
    # The block's largest element is exact (its code is cmax).
    blocks = torch.nn.functional.pad(x.abs(), (0, -4097 % quant_maps.QBLOCK)).view(
        -1, quant_maps.QBLOCK
    )
    assert torch.equal(scales, blocks.amax(1))
    # Decoding is a fixed function of the codes: quantizing the decoded state again gives it back.
    codes2, scales2 = quant_maps.quantize(deq, kind)
    assert torch.equal(quant_maps.dequantize(codes2, scales2, kind), deq)


@pytest.mark.parametrize("kind", ["momentum", "adam_m", "adam_v"])
def test_stochastic_rounding_is_unbiased(kind):
    """Many copies of one value between two codes (in different blocks and columns, so with
    different noise) average to the value: the rounding is unbiased in value space, which is
    what keeps a slowly moving EMA from stalling."""
    cmap, blocks = quant_maps.MAPS[kind], 64
    # A quarter of the way from one code to the next: round-to-nearest would always round
    # down, a bias of a quarter step.
    c = math.floor(0.3 ** (1 / cmap.power) * cmap.cmax)
    lo, hi = (c / cmap.cmax) ** cmap.power, ((c + 1) / cmap.cmax) ** cmap.power
    x = torch.full((blocks, quant_maps.QBLOCK), 0.75 * lo + 0.25 * hi, dtype=torch.float64)
    x += torch.arange(blocks * quant_maps.QBLOCK).view(blocks, -1) * 1e-9  # distinct bits, so noise
    x[:, 0] = 1.0  # the absmax of every block
    x = x.float()
    deq = quant_maps.dequantize(*quant_maps.quantize(x, kind), kind)
    _assert_within_step(deq, x, kind)
    lo, hi = _bracket64(x, kind)
    step = (hi - lo)[1:].max().item()
    # 16320 Bernoulli draws of spread <= step: the mean's standard error <= step / 2 / 127.
    bias = (deq.double() - x.double())[:, 1:].mean().item()
    assert abs(bias) < 5 * 0.5 * step / math.sqrt(x[:, 1:].numel()) < 0.05 * step


def _lists(device, p_dtype, kinds, seed=0):
    p = [randn(n, p_dtype, device) for n in SIZES]
    g = [randn(n, p_dtype, device) for n in SIZES]
    state = []
    for k, kind in enumerate(kinds):
        pairs = [_state(kind, n, device, seed=seed + 10 * k + i) for i, n in enumerate(SIZES)]
        state += [[c for c, _ in pairs], [s for _, s in pairs]]
    return [p, g, *state]


def _clone(lists):
    return [[t.clone() for t in ts] for ts in lists]


def _assert_codes_match(actual, expected, device):
    """Bit for bit on the CPU (the interpreter runs numpy's IEEE fp32 in the reference's
    order). On the GPU the kernels round products before sums, as torch does, and the square
    roots and divisions are correctly rounded on both, so we expect equality there too; one
    code step is allowed where a library's fp32 op might round differently."""
    for a, e in zip(actual, expected, strict=True):
        if device == "cpu":
            assert torch.equal(a, e)
        elif a.dtype == F32:
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
        else:
            assert (a.int() - e.int()).abs().max() <= 1


def _assert_params(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        a32, e32 = a.float().cpu(), e.float().cpu()
        assert not torch.isnan(a32).any()
        if a.dtype == F32:
            # Measured: 1-2 fp32 ulps in <= 0.7% of elements under the interpreter (its scalar
            # arguments take another path through numpy than torch's); codes agree exactly.
            # atol: one ulp of the operands (|p| < 1) where p (1 - lr wd) - step cancels.
            torch.testing.assert_close(a32, e32, rtol=6e-7, atol=6e-8)
        else:  # the interpreter truncates to bf16, the GPU and torch round
            assert ((a32 - e32).abs() <= bf16_ulp(e32) * 1.001).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cautious_wd", [False, True], ids=["wd", "cautious_wd"])
def test_adamw8_matches_reference(device, p_dtype, cautious_wd):
    lists = _lists(device, p_dtype, ["adam_m", "adam_v"])
    ref = _clone(lists)
    ew8.adamw8_(*lists, **ADAMW, step=7, cautious_wd=cautious_wd)
    ref8.adamw8_reference_(*ref, **ADAMW, step=7, cautious_wd=cautious_wd)
    _assert_params(lists[0], ref[0])
    for j in range(2, 6):
        _assert_codes_match(lists[j], ref[j], device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cautious_wd", [False, True], ids=["wd", "cautious_wd"])
def test_lion8_matches_reference(device, p_dtype, cautious_wd):
    lists = _lists(device, p_dtype, ["momentum"])
    ref = _clone(lists)
    ew8.lion8_(*lists, **LION, cautious_wd=cautious_wd)
    ref8.lion8_reference_(*ref, **LION, cautious_wd=cautious_wd)
    _assert_params(lists[0], ref[0])
    for j in (2, 3):
        _assert_codes_match(lists[j], ref[j], device)


def _prep_inputs(device, batch, shape=(37, 53), g_dtype=F32):
    pairs = [_state("momentum", math.prod(shape), device, seed=i) for i in range(batch)]
    codes = [c.view(shape) for c, _ in pairs]
    scales = [s for _, s in pairs]
    gen = torch.Generator().manual_seed(99)
    grads = [torch.randn(shape, generator=gen).to(device, g_dtype) for _ in range(batch)]
    return codes, scales, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_prep8_matches_reference(device, nesterov):
    codes, scales, grads = _prep_inputs(device, 3)
    ref = _clone([codes, scales, grads])
    out = torch.full((3, 37, 53), float("nan"), dtype=BF16, device=device)  # all must be written
    sumsq = torch.full((3,), float("nan"), device=device)
    u, s = muon8.muon_prep8(codes, scales, grads, mu=0.95, nesterov=nesterov, out=out, sumsq=sumsq)
    u_ref, s_ref = muon8.muon_prep8_reference(*ref, mu=0.95, nesterov=nesterov)
    _assert_codes_match(codes, ref[0], device)
    _assert_codes_match(scales, ref[1], device)
    _assert_params(list(u), list(u_ref))
    # The kernel's sums are of its own stored update (fp32 partial sums: ~1e-6 relative).
    own = u.double().square().sum(dim=(1, 2))
    torch.testing.assert_close(s.double(), own, rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_muon_prep8_same_bits_in_any_batch(device):
    """A matrix prepared alone or beside others: the same update, codes and sum, bit for bit."""
    codes, scales, grads = _prep_inputs(device, 3)
    alone = _clone([codes[1:2], scales[1:2], grads[1:2]])
    u, s = muon8.muon_prep8(codes, scales, grads, mu=0.9, nesterov=True)
    u1, s1 = muon8.muon_prep8(*alone, mu=0.9, nesterov=True)
    assert torch.equal(u[1], u1[0]) and torch.equal(s[1:2], s1)
    assert torch.equal(codes[1], alone[0][0]) and torch.equal(scales[1], alone[1][0])


def test_references_match_float64_rederivation():
    """adamw8_reference_ against AdamW written here in float64 on the dequantized state: the
    parameter to fp32 rounding, the new state within one code step of the float64 state."""
    lists = _lists("cpu", F32, ["adam_m", "adam_v"])
    p0, g, mc0, ms0, vc0, vs0 = _clone(lists)
    ref8.adamw8_reference_(*lists, **ADAMW, step=3)
    h = ADAMW
    for i in range(len(SIZES)):
        m = quant_maps.dequantize(mc0[i], ms0[i], "adam_m").double()
        v = quant_maps.dequantize(vc0[i], vs0[i], "adam_v").double()
        g64 = g[i].double()
        m = h["beta1"] * m + (1 - h["beta1"]) * g64
        v = h["beta2"] * v + (1 - h["beta2"]) * g64 * g64
        denom = (v / (1 - h["beta2"] ** 3)).sqrt() + h["eps"]
        p = (
            p0[i].double() * (1 - h["lr"] * h["weight_decay"])
            - h["lr"] / (1 - h["beta1"] ** 3) * m / denom
        )
        # fp32 rounding of p (|p| ~ 1, ulp 1.2e-7): measured 8e-9 at most.
        torch.testing.assert_close(lists[0][i].double(), p, rtol=1e-5, atol=1e-7)
        _assert_within_step(quant_maps.dequantize(lists[2][i], lists[3][i], "adam_m"), m, "adam_m")
        _assert_within_step(quant_maps.dequantize(lists[4][i], lists[5][i], "adam_v"), v, "adam_v")
    # Lion and Muon prep: the momentum rule in float64.
    lists = _lists("cpu", F32, ["momentum"])
    p0, g, mc0, ms0 = _clone(lists)
    ref8.lion8_reference_(*lists, **LION)
    for i in range(len(SIZES)):
        m = quant_maps.dequantize(mc0[i], ms0[i], "momentum").double()
        m = LION["beta2"] * m + (1 - LION["beta2"]) * g[i].double()
        _assert_within_step(
            quant_maps.dequantize(lists[2][i], lists[3][i], "momentum"), m, "momentum"
        )
    codes, scales, grads = _prep_inputs("cpu", 2)
    before = [
        quant_maps.dequantize(c, s, "momentum").double() for c, s in zip(codes, scales, strict=True)
    ]
    u, _ = muon8.muon_prep8_reference(codes, scales, grads, mu=0.95, nesterov=False)
    for i in range(2):
        m = 0.95 * before[i] + grads[i].double()
        _assert_within_step(quant_maps.dequantize(codes[i], scales[i], "momentum"), m, "momentum")
        assert ((u[i].double() - m).abs() <= bf16_ulp(m) * 0.5 + 1e-12).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_gradient_poisons_only_its_blocks(device):
    """A NaN gradient element in segment 0 turns that block's scale NaN (its codes 0) and
    that element's parameter NaN; every other block, of that parameter or another, is as in
    a run without the NaN."""
    lists = _lists(device, F32, ["adam_m", "adam_v"])
    clean = _clone(lists)
    lists[1][0][300] = float("nan")  # block 1 of segment 0
    ew8.adamw8_(*lists, **ADAMW, step=2)
    ew8.adamw8_(*clean, **ADAMW, step=2)
    for j in (3, 5):
        assert torch.isnan(lists[j][0][1]) and not torch.isnan(clean[j][0][1])
        keep = torch.ones_like(lists[j][0], dtype=torch.bool)
        keep[1] = False
        assert torch.equal(lists[j][0][keep], clean[j][0][keep])
        for a, e in zip(lists[j][1:], clean[j][1:], strict=True):
            assert torch.equal(a, e)
    for j in (2, 4):
        assert (lists[j][0][256:512] == 0).all()
    assert torch.isnan(lists[0][0][300]) and torch.isnan(lists[0][0]).sum() == 1
    # The next step: the poisoned block's elements turn NaN, nothing else does.
    ew8.adamw8_(*lists, **ADAMW, step=3)
    assert torch.isnan(lists[0][0][256:512]).all()
    assert not torch.isnan(lists[0][0][:256]).any() and not torch.isnan(lists[0][0][512:]).any()
    assert not any(torch.isnan(t).any() for t in lists[0][1:])


def _adam_run(steps, n=4096, seed=0):
    """AdamW's reference on 8-bit and on fp32 state, fed the same gradients: a quarter of the
    elements get gradients 10x smaller from step steps // 3 and every 8th element none at all
    (a unit that stops), so v must decay and m must reach 0 inside live blocks."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(n, generator=gen))
    mean = 0.3 * torch.randn(n, generator=gen)
    p8, p32 = randn(n, F32, "cpu"), None
    p32 = p8.clone()
    m8, v8 = (
        quant_maps.quantize(torch.zeros(n), "adam_m"),
        quant_maps.quantize(torch.zeros(n), "adam_v"),
    )
    m8, v8 = list(m8), list(v8)
    m32, v32 = torch.zeros(n), torch.zeros(n)
    dead = torch.zeros(n, dtype=torch.bool)
    dead[::8] = True
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    for t in range(1, steps + 1):
        s = scale.clone()
        if t >= steps // 3:
            s[: n // 4] *= 0.1
            s[dead] = 0
        g = s * (mean + torch.randn(n, generator=gen))
        ref8.adamw8_reference_([p8], [g], [m8[0]], [m8[1]], [v8[0]], [v8[1]], **hyper, step=t)
        adamw_reference_([p32], [g], [m32], [v32], **hyper, step=t)
    return (
        p8,
        p32,
        quant_maps.dequantize(*m8, "adam_m"),
        m32,
        quant_maps.dequantize(*v8, "adam_v"),
        v32,
        dead,
    )


def test_200_steps_track_fp32_state():
    """Measured (this run): after 200 steps the dequantized state is within |dm| / |m| = 0.037
    and |dv| / |v| = 0.034 of fp32 state, the parameters' total movement within 0.2% of
    fp32's, v of the shrunk quarter 0.995 of fp32's on average, and the momentum of stopped
    elements 8e-6 of the live maximum. Bounds are ~2-3x these (the shrunk quarter's 2%:
    round-to-nearest kept v ~3% high in the same scenario, bench/quantized_scheme.py at
    commit 0f61ca5)."""
    p8, p32, m8, m32, v8, v32, dead = _adam_run(200)
    assert ((m8 - m32).norm() / m32.norm()).item() < 0.1
    assert ((v8 - v32).norm() / v32.norm()).item() < 0.08
    p0 = _adam_run(0)[0]
    moved8, moved32 = (p8 - p0), (p32 - p0)
    assert ((moved8 - moved32).norm() / moved32.norm()).item() < 0.01
    shrunk = slice(0, 4096 // 4)
    ratio = (v8[shrunk].double().mean() / v32[shrunk].double().mean()).item()
    assert abs(ratio - 1) < 0.02
    # Stopped elements: 8e-6 of the live maximum measured; round-to-nearest freezes them at
    # the smallest code that a 10% decay cannot leave, (20 / 127)^4 = 6e-4 of their block's.
    assert m8[dead].abs().max() < 1e-4 * m8[~dead].abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_checks_refuse_wrong_layouts(device):
    lists = _lists(device, F32, ["adam_m", "adam_v"])
    bad = _clone(lists)
    bad[3][0] = bad[3][0][:-1]  # one scale short
    with pytest.raises(ValueError, match="scales"):
        ew8.adamw8_(*bad, **ADAMW, step=1)
    bad = _clone(lists)
    bad[4][0] = bad[4][0].view(torch.int8)  # v codes must be uint8
    with pytest.raises(ValueError, match="uint8"):
        ew8.adamw8_(*bad, **ADAMW, step=1)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter only")
def test_interpreter_config_covers_tail_and_several_tiles():
    assert ew8.INTERPRETER_CONFIG.chunk % ew8.INTERPRETER_CONFIG.block == 0
    assert ew8.INTERPRETER_CONFIG.block % quant_maps.QBLOCK == 0
    assert all(c.block % quant_maps.QBLOCK == 0 and c.chunk % c.block == 0 for c in ew8.CONFIGS)


def _segments(n=2, numel=700):
    params = [torch.randn(numel) for _ in range(n)]
    grads = [torch.randn(numel) for _ in range(n)]
    blocks = -(-numel // quant_maps.QBLOCK)
    m = ([torch.zeros(numel, dtype=torch.int8) for _ in range(n)], [torch.ones(blocks)] * n)
    v = ([torch.zeros(numel, dtype=torch.uint8) for _ in range(n)], [torch.ones(blocks)] * n)
    return params, grads, m, v


def _break(what: str, params, grads, m, v) -> str:
    """Spoil one segment list as ``what`` says; the message the check must give."""
    if what == "count":
        grads.pop()
        return "grads: 1 tensors, expected 2"
    if what == "numel":
        grads[1] = torch.randn(699)
        return "grads: element counts differ from params'"
    if what == "strided":
        m[0][1] = torch.zeros(1400, dtype=torch.int8)[::2]
        return "m_codes: every tensor must be contiguous"
    if what == "code dtype":
        v[0][0] = torch.zeros(700, dtype=torch.int8)
        return r"v_codes\[0\] is torch.int8, expected torch.uint8"
    if what == "scale count":
        m[1][1] = torch.ones(2)
        return r"m_codes scales\[1\]: 2 torch.float32, expected 3 float32"
    if what == "scale dtype":
        v[1][0] = torch.ones(3, dtype=torch.float64)
        return r"v_codes scales\[0\]: 3 torch.float64"
    if what == "scales list":
        m[1].pop()
        return "m_codes: 1 scales lists for 2 codes"
    raise AssertionError(what)


@pytest.mark.parametrize(
    "what",
    ["count", "numel", "strided", "code dtype", "scale count", "scale dtype", "scales list"],
)
def test_bad_segments_raise_before_any_state_is_written(what):
    params, grads, m, v = _segments()
    message = _break(what, params, grads, m, v)
    m, v = (list(m[0]), list(m[1])), (list(v[0]), list(v[1]))
    before = [t.clone() for t in (*params, *m[0], *m[1], *v[0], *v[1])]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
    with pytest.raises(ValueError, match=message):
        ew8.adamw8_(params, grads, *m, *v, **hyper)
    after = [*params, *m[0], *m[1], *v[0], *v[1]]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
