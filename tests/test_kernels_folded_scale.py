"""The normalization folded into Polar Express's first iteration: ``sym_gram`` and
``poly_apply`` with a per-matrix scale (``sumsq``, ``norm_scale``, ``eps``), against float64
references written here, and ``orthogonalize_on(products="triton_all")``, which uses them,
against float64 Polar Express. Under the interpreter ``tl.dot`` on bf16 is garbage, so the CPU
tests use fp32 and fp16; the GPU tests bf16, the TMA kernels with each config forced."""

from __future__ import annotations

import pytest
import torch
from _kernel_utils import DEVICES as KERNEL_DEVICES
from _kernel_utils import assert_within_rounding, bf16_input, padded, poisoned
from muon_offload.kernels import gram as gram_module
from muon_offload.kernels import orthogonalize as ortho_module
from muon_offload.kernels import poly_apply as poly_apply_module
from muon_offload.kernels.gram import sym_gram, sym_gram_reference
from muon_offload.kernels.normalize import norm_scale_arg, normalize
from muon_offload.kernels.orthogonalize import POLAR_EXPRESS_NORM_SCALE, orthogonalize_on
from muon_offload.kernels.poly_apply import poly_apply, poly_apply_reference

from reference64 import POLAR_EXPRESS, orthogonalize64

NORM_SCALE = POLAR_EXPRESS_NORM_SCALE


@pytest.fixture
def untuned(monkeypatch):
    """Correctness tests of small shapes: the first GPU config, no tuning (device time)."""
    monkeypatch.setenv("MUON_OFFLOAD_AUTOTUNE", "0")


def _scale64(sumsq, eps):
    """Each matrix's scale as the normalization defines it (fp32 square root, product, sum
    and division, rounded to bf16), as float64 [B, 1, 1]."""
    s = 1.0 / (sumsq.float().cpu().sqrt() * NORM_SCALE + eps)
    return s.to(torch.bfloat16).double()[:, None, None]


def _unnormalized(shape, dtype, device, gen, transposed=False):
    """Random x (never zeros), of norm far from 1 (the scale matters), and its sums of
    squares [B] fp32 as the Muon prep kernel hands them over; x a ``.mT`` view if asked."""
    batch, m, k = shape
    stored = (batch, k, m) if transposed else shape
    x = (torch.randn(stored, generator=gen) * 7.3).to(dtype).to(device)
    x = x.mT if transposed else x
    return x, x.double().square().sum(dim=(1, 2)).float()


def _eps_arg(eps, as_tensor, device):
    return torch.tensor([eps], dtype=torch.float32, device=device) if as_tensor else eps


# --- sym_gram: alpha s^2 x x^T (+ beta y) -----------------------------------------------


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "m,k,transposed", [(1, 7, False), (40, 70, False), (75, 45, True)], ids=str
)
def test_sym_gram_scale_matches_float64(device, dtype, m, k, transposed, untuned):
    """Odd sizes under the interpreter's 32 x 32 tiles (one row; partial tiles and K steps;
    x a ``.mT`` view), eps a number and a device tensor, the output NaN-poisoned; x and
    sumsq only read."""
    gen = torch.Generator().manual_seed(m * k)
    x, sumsq = _unnormalized((3, m, k), dtype, device, gen, transposed)
    x_before, sumsq_before = x.clone(), sumsq.clone()
    for eps_tensor in (False, True):
        eps = _eps_arg(1e-3, eps_tensor, device)  # large enough to show in the scale
        out = poisoned((3, m, m), dtype, device)
        kw = dict(sumsq=sumsq, norm_scale=NORM_SCALE, eps=eps)
        assert sym_gram(x, alpha=0.75, out=out, **kw) is out
        x64 = x.double().cpu()
        want = 0.75 * _scale64(sumsq, 1e-3) ** 2 * (x64 @ x64.mT)
        assert not torch.isnan(out).any(), "NaN in output (a tile left unwritten?)"
        terms = 0.75 * _scale64(sumsq, 1e-3) ** 2 * (x64.abs() @ x64.abs().mT)
        assert_within_rounding(out, want.float(), terms.float())
        ref = sym_gram_reference(x, alpha=0.75, **kw).float().cpu()  # the module's own
        assert_within_rounding(out, ref, terms.float())
    assert torch.equal(x, x_before) and torch.equal(sumsq, sumsq_before)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sym_gram_scale_multiplies_the_product_only(device, dtype, untuned):
    """With y and a diagonal: alpha s^2 x x^T + beta y + diag I (y and I unscaled)."""
    gen = torch.Generator().manual_seed(9)
    x, sumsq = _unnormalized((2, 40, 24), dtype, device, gen)
    y = torch.randn(2, 40, 40, generator=gen)
    y = (y + y.mT).to(dtype).to(device)
    out = poisoned((2, 40, 40), dtype, device)
    sym_gram(x, alpha=0.42, y=y, beta=-1.7, diag=2.5, out=out, sumsq=sumsq,
             norm_scale=NORM_SCALE, eps=1e-8)  # fmt: skip
    x64, s2 = x.double().cpu(), _scale64(sumsq, 1e-8) ** 2
    eye = torch.eye(40, dtype=torch.float64)
    want = 0.42 * s2 * (x64 @ x64.mT) - 1.7 * y.double().cpu() + 2.5 * eye
    assert not torch.isnan(out).any()
    terms = 0.42 * s2 * (x64.abs() @ x64.abs().mT) + 1.7 * y.double().cpu().abs() + 2.5
    assert_within_rounding(out, want.float(), terms.float())


# --- poly_apply: s (alpha x + P x) --------------------------------------------------------


def _symmetric(batch, m, dtype, device, gen):
    b = torch.randn((batch, m, m), generator=gen)
    return ((b + b.mT) / (2 * m**0.5)).to(device=device, dtype=dtype)


def _check_apply(out, poly, x, alpha, sumsq, eps):
    assert not torch.isnan(out).any(), "NaN in output (a tile left unwritten?)"
    p64, x64, s = poly.double().cpu(), x.double().cpu(), _scale64(sumsq, eps)
    want = s * (alpha * x64 + p64 @ x64)
    terms = s * (abs(alpha) * x64.abs() + p64.abs() @ x64.abs())
    assert_within_rounding(out, want.float(), terms.float())
    return terms.float()


# Under the interpreter's 32 x 32 tiles: 1 x 7 (one partial tile); 70 x 90 (partial tiles
# both ways, K not a multiple of the K step; x a .mT view); 64 x 64 (no masks).
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "m,n,transposed", [(1, 7, False), (70, 90, True), (64, 64, False)], ids=str
)
def test_poly_apply_scale_matches_float64(device, dtype, m, n, transposed, untuned):
    gen = torch.Generator().manual_seed(m + n)
    x, sumsq = _unnormalized((2, m, n), dtype, device, gen, transposed)
    poly = _symmetric(2, m, dtype, device, gen)
    x_before = x.clone()
    for alpha, eps_tensor in ((3.8917, True), (0.0, False)):
        out = poisoned((2, m, n), dtype, device)
        eps = _eps_arg(1e-3, eps_tensor, device)
        kw = dict(sumsq=sumsq, norm_scale=NORM_SCALE, eps=eps)
        assert poly_apply(poly, x, alpha=alpha, out=out, **kw) is out
        terms = _check_apply(out, poly, x, alpha, sumsq, 1e-3)
        ref = poly_apply_reference(poly, x, alpha=alpha, **kw).float().cpu()  # the module's
        assert_within_rounding(out, ref, terms)
    assert torch.equal(x, x_before)


def test_scale_arguments_are_validated_before_launch():
    x = torch.randn(2, 8, 12)
    poly = _symmetric(2, 8, torch.float32, "cpu", torch.Generator().manual_seed(0))
    good = dict(sumsq=torch.ones(2), norm_scale=1.02, eps=1e-8)
    bad_sumsq = [torch.ones(3), torch.ones(2, dtype=torch.float64), torch.ones(4)[::2]]
    for fn in (lambda **kw: sym_gram(x, **kw), lambda **kw: poly_apply(poly, x, **kw)):
        for sumsq in bad_sumsq:
            with pytest.raises(ValueError, match="sumsq must be contiguous float32"):
                fn(**{**good, "sumsq": sumsq})
        with pytest.raises(ValueError, match="give sumsq too"):
            fn(norm_scale=1.02, eps=1e-8)
        with pytest.raises(ValueError, match="needs norm_scale and eps"):
            fn(sumsq=torch.ones(2), norm_scale=1.02)
        with pytest.raises(ValueError, match="scalars must be"):
            fn(**{**good, "eps": torch.ones(1, dtype=torch.float64)})
    assert norm_scale_arg(None, None, None, 2, torch.device("cpu")) is None


# --- orthogonalize: the fold on the "triton_all" path -------------------------------------


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _polar_express64(u, sumsq, eps=1e-8):
    """Polar Express in float64 from X0 = s U with the kernels' bf16 scale s (so that the
    scale's rounding, which both paths share, does not hide the products' error)."""
    x = u.double()
    tall = x.size(-2) > x.size(-1)
    x = (x.mT if tall else x) * _scale64(sumsq, eps).to(x.device)
    for a, b, c in POLAR_EXPRESS:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", [(2, 24, 40), (2, 70, 40)], ids=str)
def test_orthogonalize_folded_matches_float64(device, shape, untuned):
    """fp32 input (the interpreter's dot is exact enough), wide and tall: the folded path
    against float64 Polar Express and against the cuBLAS path (which normalizes first); the
    caller's U is only read."""
    gen = torch.Generator().manual_seed(sum(shape))
    u, sumsq = _unnormalized(shape, torch.float32, device, gen)
    u_before = u.clone()
    got = orthogonalize_on(u, sumsq, products="triton_all")
    assert torch.equal(u, u_before), "the caller's U was written"
    assert got.shape == u.shape and not torch.isnan(got).any()
    cublas = orthogonalize_on(u, sumsq, products="cublas").double().cpu()
    # Measured (CPU, triton 3.9 interpreter, seeds 0 to 2 of each shape): from float64 with
    # the same bf16 scale 1.8e-6 to 2.8e-6 (the cuBLAS path: 2.2e-6 to 2.7e-6), 1.9e-6 to
    # 2.1e-6 between the two. From float64 with the exact scale 0.5% to 2.3%, both paths
    # alike: the scale's bf16 rounding (up to 2^-9) moves the singular values that five
    # iterations leave unconverged (test_math's 3% covers it).
    assert _rel(got.cpu(), _polar_express64(u.cpu(), sumsq)) < 1e-5
    assert _rel(got.cpu(), cublas) < 1e-5
    assert _rel(got.cpu(), torch.stack([orthogonalize64(m) for m in u.cpu()])) < 3e-2


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_orthogonalize_folded_zero_matrix_with_a_tiny_eps(device, untuned):
    """A zero matrix (a padding one, an unused expert's) with eps = 1e-30: s = 1e30, whose
    square overflows fp32; its update must be zero, as on the path that normalizes first."""
    gen = torch.Generator().manual_seed(4)
    u, sumsq = _unnormalized((3, 24, 40), torch.float32, device, gen)
    u[1] = 0.0
    sumsq[1] = 0.0
    got = orthogonalize_on(u, sumsq, eps=1e-30, products="triton_all")
    assert not torch.isnan(got).any() and torch.equal(got[1], torch.zeros_like(got[1]))
    cublas = orthogonalize_on(u, sumsq, eps=1e-30, products="cublas")
    assert _rel(got.cpu(), cublas.double().cpu()) < 1e-5


def test_orthogonalize_folded_writes_two_fresh_buffers(monkeypatch, untuned):
    """The first iteration reads the caller's U: it never becomes poly_apply's output, and
    the outputs rotate over two fresh buffers (the unfolded path's count: normalize's copy
    and one more)."""
    outs = []
    real = ortho_module.poly_apply

    def recording(poly, x, **kw):
        outs.append(kw["out"].data_ptr())
        return real(poly, x, **kw)

    monkeypatch.setattr(ortho_module, "poly_apply", recording)
    gen = torch.Generator().manual_seed(1)
    for transposed in (False, True):
        outs.clear()
        u, sumsq = _unnormalized((2, 24, 40), torch.float32, "cpu", gen, transposed)
        if transposed:
            u = u.mT  # tall [2, 40, 24]: runs on its .mT, the wide contiguous view
        orthogonalize_on(u, sumsq, products="triton_all")
        assert len(outs) == 5 and len(set(outs)) == 2, outs
        assert u.data_ptr() not in outs


# --- GPU: bf16, the TMA kernels with each config forced ----------------------------------

GRAM_TMA_CONFIGS = [c for c in gram_module.GRAM_CONFIGS if c.tma]
POLY_TMA_CONFIGS = [c for c in poly_apply_module.POLY_APPLY_CONFIGS if c.tma]


def _bf16_scaled(batch, m, k, transposed, seed):
    x = bf16_input(batch, m, k, transposed, seed)
    x.mul_(7.3)  # in place on the view: a norm far from 1
    return x, x.double().square().sum(dim=(1, 2)).float()


@pytest.mark.cuda
@pytest.mark.parametrize(
    "config", [*GRAM_TMA_CONFIGS, gram_module.GRAM_CONFIGS[0]], ids=lambda c: c.label()
)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m,k", [(77, 1000), (768, 2048)], ids=str)
def test_sym_gram_scale_tma_configs(config, transposed, m, k):
    """Each TMA config (and the pointer kernel) forced, bf16, an odd size and the qwen3
    expert shape, rows contiguous or a ``.mT`` view: s^2 X X^T within one bf16 ulp of float64
    (plus accumulation order); a matrix alone has the bits it has in a batch of 5."""
    from muon_offload.kernels import _tma

    x, sumsq = _bf16_scaled(5, m, k, transposed, seed=m + k)
    assert _tma.tma_layout(x) is not None
    x_before = x.clone()
    scale = norm_scale_arg(sumsq, NORM_SCALE, 1e-8, 5, x.device)
    gram = poisoned((5, m, m), torch.bfloat16, "cuda")
    gram_module._launch(x, x, None, gram, 1.0, 0.0, 0.0, False, config, scale)
    x64, s2 = x.double().cpu(), _scale64(sumsq, 1e-8) ** 2
    assert not torch.isnan(gram).any()
    want = s2 * (x64 @ x64.mT)
    assert_within_rounding(gram, want.float(), (s2 * (x64.abs() @ x64.abs().mT)).float())
    alone = poisoned((1, m, m), torch.bfloat16, "cuda")
    one = norm_scale_arg(sumsq[3:4], NORM_SCALE, 1e-8, 1, x.device)
    gram_module._launch(x[3:4], x[3:4], None, alone, 1.0, 0.0, 0.0, False, config, one)
    assert torch.equal(alone[0], gram[3])
    assert torch.equal(x, x_before)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "config",
    [*POLY_TMA_CONFIGS, poly_apply_module.POLY_APPLY_CONFIGS[0]],
    ids=lambda c: c.label(),
)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m,n", [(77, 1000), (768, 2048)], ids=str)
def test_poly_apply_scale_tma_configs(config, transposed, m, n):
    """As for sym_gram: s (a X + P X) with each config forced, x a ``.mT`` view or not, the
    caller's x only read, a matrix alone equal to its batch's."""
    from muon_offload.kernels import _tma

    x, sumsq = _bf16_scaled(5, m, n, transposed, seed=m * n)
    gen = torch.Generator().manual_seed(m)
    poly = padded(_symmetric(5, m, torch.bfloat16, "cuda", gen))
    assert _tma.tma_layout(x) is not None and _tma.tma_layout(poly) is not None
    x_before = x.clone()
    scale = norm_scale_arg(sumsq, NORM_SCALE, 1e-8, 5, x.device)
    out = poisoned((5, m, n), torch.bfloat16, "cuda")
    poly_apply_module._launch(poly, x, out, 3.8917, config, scale)
    _check_apply(out, poly, x, 3.8917, sumsq, 1e-8)
    alone = poisoned((1, m, n), torch.bfloat16, "cuda")
    one = norm_scale_arg(sumsq[2:3], NORM_SCALE, 1e-8, 1, x.device)
    poly_apply_module._launch(poly[2:3], x[2:3], alone, 3.8917, config, one)
    assert torch.equal(alone[0], out[2])
    assert torch.equal(x, x_before)


@pytest.mark.cuda
@pytest.mark.parametrize("tma", ["0", "1"])
@pytest.mark.parametrize("shape", [(16, 768, 2048), (4, 2048, 768), (3, 200, 300)], ids=str)
def test_orthogonalize_folded_bf16_vs_float64(shape, tma, monkeypatch):
    """bf16 on the bench shapes, tuned (TMA configs offered or not): the folded path against
    float64 within test_math's update tolerance (3%), no farther than the unfolded path
    (normalize, then the same products) from float64 started with the same bf16 scale (5%
    margin: the rounding noise of two equally good orders), no more peak memory than it, and
    the caller's U unchanged."""
    monkeypatch.setenv("MUON_OFFLOAD_TMA", tma)
    torch.manual_seed(0)
    u = torch.randn(shape, device="cuda").to(torch.bfloat16)
    sumsq = u.float().square().sum(dim=(1, 2))
    u_before = u.clone()
    x = u.mT if shape[1] > shape[2] else u

    def unfolded():
        x0 = normalize(x, sumsq, norm_scale=NORM_SCALE, eps=1e-8)
        out = ortho_module._iterate(x0, ortho_module.POLAR_EXPRESS_COEFFS, True, True, True)
        return out.mT if x is not u else out

    def folded():
        return orthogonalize_on(u, sumsq, products="triton_all")

    peaks, results = {}, {}
    for name, fn in (("unfolded", unfolded), ("folded", folded)):
        fn()  # tunes and compiles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        results[name] = fn()[:4]
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    assert torch.equal(u, u_before), "the caller's U was written"
    exact = torch.stack([orthogonalize64(m) for m in u[:4]])
    same = _polar_express64(u[:4], sumsq[:4])
    err = {k: (_rel(r, exact), _rel(r, same)) for k, r in results.items()}
    print(f"{shape} tma={tma}: vs f64 (exact scale, same scale) {err}; peak bytes {peaks}")
    assert err["folded"][0] < 3e-2
    assert err["folded"][1] <= 1.05 * err["unfolded"][1]
    assert peaks["folded"] <= peaks["unfolded"]
