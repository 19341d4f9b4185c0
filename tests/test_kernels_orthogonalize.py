"""Batched Polar Express / Newton-Schulz orthogonalization, and the Triton products it can run
on: the symmetric ones (``sym_gram``) and ``a X + B X`` (``poly_apply``). Under the interpreter
``tl.dot`` on bf16 is garbage, so the CPU tests of the kernels use fp32 and fp16; the GPU tests
use bf16."""

from __future__ import annotations

import pytest
import torch
from _kernel_utils import DEVICES as KERNEL_DEVICES
from _kernel_utils import assert_within_rounding, bf16_input, padded, poisoned, randn
from muon_offload.kernels import _launch, _tma
from muon_offload.kernels import gram as gram_module
from muon_offload.kernels import poly_apply as poly_apply_module
from muon_offload.kernels.gram import sym_gram, sym_gram_reference
from muon_offload.kernels.muon import muon_prep, muon_prep_reference
from muon_offload.kernels.orthogonalize import orthogonalize, orthogonalize_on, products_for
from muon_offload.kernels.poly_apply import poly_apply, poly_apply_reference

from reference64 import orthogonalize64

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double().cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(32, 48), (48, 32)], ids=str)
@pytest.mark.parametrize("method", ["polar_express", "newton_schulz5"])
def test_output_is_near_orthogonal(device, shape, method):
    torch.manual_seed(0)
    u = torch.randn(3, *shape, device=device).to(torch.bfloat16)
    out = orthogonalize(u, method=method)
    assert out.shape == u.shape and out.dtype == torch.bfloat16
    s = _singular_values(out)
    # Both methods drive singular values into a band around 1 (Newton-Schulz5's is wider,
    # about [0.7, 1.2], by design of its coefficients); bf16 products add about 1%.
    assert s.min() > 0.5 and s.max() < 1.3, (s.min().item(), s.max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["polar_express", "gram_newton_schulz"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=str)
def test_given_sumsq_equals_computed(device, method, shape):
    """The prep kernel's sum of squares of the stored bf16 values is what orthogonalize
    would compute itself (the same order on CUDA, torch's on the CPU): passing it changes
    nothing."""
    gen = torch.Generator().manual_seed(11)
    momentums = [torch.randn(shape, generator=gen).to(device) for _ in range(2)]
    grads = [torch.randn(shape, generator=gen).to(device) for _ in range(2)]
    prep = muon_prep if device == "cuda" else muon_prep_reference
    u, sumsq = prep(momentums, grads, mu=0.9, nesterov=True)
    assert torch.equal(orthogonalize(u, sumsq, method=method), orthogonalize(u, method=method))


@pytest.mark.parametrize("given_sumsq", [True, False])
@pytest.mark.parametrize("method", ["polar_express", "newton_schulz5"])
def test_auto_on_the_cpu_is_the_torch_path(method, given_sumsq):
    """On CPU tensors "auto" means the torch expressions, normalization included, under the
    interpreter too: its fp32 -> bf16 casts truncate, so an interpreted normalization made
    every bf16 value of X smaller by up to an ulp (the scale too), and test_math's 3-D
    updates went from at most 2.1% to at most 3.9% off float64."""
    torch.manual_seed(0)
    u = torch.randn(3, 20, 36).to(torch.bfloat16)
    sumsq = u.float().square().sum(dim=(-2, -1)) if given_sumsq else None
    auto = orthogonalize(u, sumsq, method=method)
    assert torch.equal(auto, orthogonalize_on(u, sumsq, method=method, products="cublas"))
    if method == "polar_express":
        ref = torch.stack([orthogonalize64(m) for m in u])
        rel = ((auto.double() - ref).norm() / ref.norm()).item()
        # 2.8% measured (CPU, torch 2.13; 2.0% to 3.1% over seeds 0 to 7); 4.3% (4.0% to
        # 6.6%) with the interpreted, truncating normalization.
        assert rel < 0.035, rel


@pytest.mark.parametrize("device", DEVICES)
def test_tall_runs_on_transpose(device):
    u = torch.randn(2, 40, 24, device=device).to(torch.bfloat16)
    tall = orthogonalize(u)
    wide = orthogonalize(u.mT.contiguous())
    assert torch.equal(tall, wide.mT)
    assert tall.stride(-2) == 1  # a .mT view: muon_apply_ reads it with its strides


def test_custom_orthogonalizer_is_called():
    calls = []

    def fn(x, epsilon):
        calls.append(epsilon)
        return x

    u = torch.randn(1, 4, 4).to(torch.bfloat16)
    assert orthogonalize(u, method=fn, eps=1e-5) is u and calls == [1e-5]


# --- sym_gram: the kernel against its torch reference ------------------------------------


@pytest.fixture
def untuned(monkeypatch):
    """Correctness tests of small shapes: the first GPU config, no tuning (device time)."""
    monkeypatch.setenv("MUON_OFFLOAD_AUTOTUNE", "0")


def _check_gram(got, x, *, alpha=1.0, y=None, beta=0.0):
    """Within one ulp of the fp32 reference's rounding (plus fp32 accumulation-order error,
    bounded by a few fp32 ulps of the sum of |terms|); fp32 outputs to a few fp32 ulps."""
    assert not torch.isnan(got).any(), "NaN in output (a tile left unwritten?)"
    want = sym_gram_reference(x, alpha=alpha, y=y, beta=beta).float().cpu()
    xf = x.float().cpu().abs()
    terms = abs(alpha) * (xf @ xf.mT) + (abs(beta) * y.float().cpu().abs() if y is not None else 0)
    assert_within_rounding(got, want, terms)


# Sizes under the interpreter's 32 x 32 tiles: 1 row; 40 rows (2 tiles a side, a partial
# one); 150 rows (5 tiles a side: 15 triangular programs, the index mapping past its first
# rows). K: a multiple of the 32-wide K step and not.
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m,k", [(1, 7), (40, 70), (150, 32)], ids=str)
def test_sym_gram_matches_reference(device, dtype, m, k, untuned):
    gen = torch.Generator().manual_seed(m + k)
    x = randn((2, m, k), dtype, device, generator=gen)
    out = poisoned((2, m, m), dtype, device)
    assert sym_gram(x, out=out) is out
    _check_gram(out, x)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sym_gram_transposed_input_and_strided_out(device, dtype, untuned):
    """x a ``.mT`` view (the tall matrices' layout), out a transposed view of a buffer."""
    gen = torch.Generator().manual_seed(1)
    x = randn((2, 45, 40), dtype, device, generator=gen).mT  # [2, 40, 45], stride(-2) == 1
    out = poisoned((2, 40, 40), dtype, device).mT
    sym_gram(x, alpha=0.5, out=out)
    _check_gram(out, x, alpha=0.5)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sym_gram_polynomial(device, dtype, untuned):
    """b A + c A A for a symmetric A (Polar Express's second product)."""
    gen = torch.Generator().manual_seed(2)
    x = randn((3, 40, 24), torch.float32, device, generator=gen)
    a = (x @ x.mT / 24).to(dtype)
    out = poisoned(a.shape, dtype, device)
    sym_gram(a, alpha=0.4232, y=a, beta=-1.7098, out=out)
    _check_gram(out, a, alpha=0.4232, y=a, beta=-1.7098)


def _far_apart(x_shape, out_shape, device, gen):
    """x [3, *x_shape] (random fp16) and out [3, *out_shape] (NaN), their matrices 2^30 + 32
    elements apart in two 4 GiB buffers allocated but never touched beyond them: the third
    matrix starts past 2^31 elements, reached only if the kernel forms batch offsets in
    int64."""
    stride = (1 << 30) + 32
    size = max(x_shape[0] * x_shape[1], out_shape[0] * out_shape[1])
    try:
        bufs = [torch.empty(2 * stride + size, dtype=torch.float16, device=device)]
        bufs.append(torch.empty_like(bufs[0]))
    except (RuntimeError, MemoryError):
        pytest.skip("needs 8 GiB of free memory on the device")
    x = bufs[0].as_strided((3, *x_shape), (stride, x_shape[1], 1))
    out = bufs[1].as_strided((3, *out_shape), (stride, out_shape[1], 1))
    x.copy_(randn((3, *x_shape), torch.float16, device, generator=gen))
    out.fill_(float("nan"))
    return x, out


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_sym_gram_int64_offset_probe(device, untuned):
    """Three matrices 2^30 + 32 elements apart (a stride that fits int32) in a 4 GiB fp16
    buffer that is allocated but never touched beyond them: the third starts past 2^31
    elements, so the kernel reaches it only if it forms the batch offset in int64."""
    gen = torch.Generator().manual_seed(4)
    x, out = _far_apart((24, 32), (24, 24), device, gen)
    sym_gram(x, out=out)
    _check_gram(out.clone(), x.clone())


# --- poly_apply: the kernel against its torch reference ----------------------------------


def _check_apply(got, poly, x, alpha):
    """As ``_check_gram``: one ulp of the fp32 reference's rounding (fp16: 2^-10 relative)
    plus fp32 accumulation-order error; fp32 outputs to a few fp32 ulps."""
    assert not torch.isnan(got).any(), "NaN in output (a tile left unwritten?)"
    want = poly_apply_reference(poly, x, alpha=alpha).float().cpu()
    xf = x.float().cpu().abs()
    terms = abs(alpha) * xf + poly.float().cpu().abs() @ xf
    assert_within_rounding(got, want, terms)


def _symmetric(batch, m, dtype, device, gen):
    b = torch.randn((batch, m, m), generator=gen)
    return ((b + b.mT) / (2 * m**0.5)).to(device=device, dtype=dtype)


# Under the interpreter's 32 x 32 tiles: 1 x 7 (one partial tile); 70 x 90 (3 x 3 tiles,
# partial ones both ways, K not a multiple of the 32-wide K step); 64 x 64 (no masks).
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m,n", [(1, 7), (70, 90), (64, 64)], ids=str)
def test_poly_apply_matches_reference(device, dtype, m, n, untuned):
    gen = torch.Generator().manual_seed(m + n)
    x = randn((2, m, n), dtype, device, generator=gen)
    poly = _symmetric(2, m, dtype, device, gen)
    out = poisoned((2, m, n), dtype, device)
    assert poly_apply(poly, x, alpha=2.3466, out=out) is out
    _check_apply(out, poly, x, 2.3466)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_poly_apply_transposed_views(device, dtype, untuned):
    """x a ``.mT`` view (the first iteration of a tall batch), poly column-major (read as its
    transpose), out a transposed view of a buffer."""
    gen = torch.Generator().manual_seed(5)
    x = randn((2, 45, 40), dtype, device, generator=gen).mT  # [2, 40, 45], stride(-2) == 1
    poly = _symmetric(2, 40, dtype, device, gen).mT.contiguous().mT
    assert poly.stride(-2) == 1
    out = poisoned((2, 45, 40), dtype, device).mT
    poly_apply(poly, x, alpha=-0.5, out=out)
    _check_apply(out, poly, x, -0.5)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_poly_apply_int64_offset_probe(device, untuned):
    """As sym_gram's: the third matrix of x and of out starts past 2^31 elements."""
    gen = torch.Generator().manual_seed(6)
    x, out = _far_apart((24, 40), (24, 40), device, gen)
    poly = _symmetric(3, 24, torch.float16, device, gen)
    poly_apply(poly, x, alpha=3.89, out=out)
    _check_apply(out.clone(), poly, x.clone(), 3.89)


def test_poly_apply_rejects_bad_arguments():
    buf = torch.randn(2 * 8 * 12 + 200 + 2 * 8 * 8)  # x, a gap, poly
    x = buf[: 2 * 8 * 12].view(2, 8, 12)
    poly = buf[-2 * 8 * 8 :].view(2, 8, 8)
    with pytest.raises(ValueError, match="overlap x"):
        poly_apply(poly, x, out=x)
    with pytest.raises(ValueError, match="overlap x"):  # shifted by 8 elements
        poly_apply(poly, x, out=buf[8 : 8 + 2 * 8 * 12].view(2, 8, 12))
    with pytest.raises(ValueError, match="overlap poly"):
        poly_apply(poly, x, out=buf[-2 * 8 * 12 :].view(2, 8, 12))
    with pytest.raises(ValueError, match="poly must be"):
        poly_apply(poly.half(), x)
    with pytest.raises(ValueError, match="out must be"):
        poly_apply(poly, x, out=torch.empty(2, 12, 8))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "products", ["triton", "triton_gram", "triton_poly", "triton_apply", "triton_all"]
)
def test_orthogonalize_triton_products_match_cublas(device, products, untuned):
    """The whole iteration on the Triton products equals the bmm path. fp32 input (the
    bf16 scale promotes it to fp32), so the interpreter's dot is exact enough; a tall batch,
    so the transposed layout goes through the kernels (poly_apply's first iteration reads the
    ``.mT`` view; later ones write into two buffers in turn)."""
    gen = torch.Generator().manual_seed(3)
    u = randn((2, 70, 40), torch.float32, device, generator=gen)
    ref = orthogonalize_on(u, products="cublas")
    got = orthogonalize_on(u, products=products)
    assert got.shape == ref.shape and got.stride() == ref.stride()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, rel


def test_orthogonalize_rejects_unknown_products():
    with pytest.raises(ValueError, match="products"):
        orthogonalize_on(torch.zeros(1, 2, 2, dtype=torch.bfloat16), products="cutlass")


@pytest.mark.parametrize(
    "shape,dtype,want",
    [
        ((128, 768, 2048), torch.bfloat16, "triton_all"),
        ((1, 768, 2048), torch.bfloat16, "triton_all"),  # the batch never decides
        ((48, 128, 2048), torch.float16, "triton_all"),
        ((12, 512, 2048), torch.float32, "cublas"),
    ],
    ids=str,
)
def test_products_for_depends_on_dtype_only(shape, dtype, want):
    assert products_for(torch.empty(shape, dtype=dtype, device="meta")) == want


# --- GPU: bf16 on the bench shapes -------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("transposed", [False, True])
def test_sym_gram_bf16_bench_shape(transposed):
    """bf16 768 x 2048 (and its transposed layout): within one bf16 ulp of the fp32 product,
    plus fp32 accumulation-order error. The polynomial on the same A likewise."""
    torch.manual_seed(0)
    x = torch.randn(4, 2048, 768, device="cuda").to(torch.bfloat16).mT
    if not transposed:
        x = x.contiguous()
    x = x / 64
    gram = sym_gram(x, out=poisoned((4, 768, 768), torch.bfloat16, "cuda"))
    _check_gram(gram, x)
    poly = sym_gram(gram, alpha=0.506, y=gram, beta=-2.77)
    _check_gram(poly, gram, alpha=0.506, y=gram, beta=-2.77)


@pytest.mark.cuda
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("config", poly_apply_module.POLY_APPLY_CONFIGS, ids=lambda c: c.label())
def test_poly_apply_bf16_bench_shape(transposed, config):
    """Every config the tuner may choose, on bf16 768 x 2048 and its transposed layout:
    within one bf16 ulp of the fp32 product, plus fp32 accumulation-order error."""
    torch.manual_seed(0)
    x = torch.randn(3, 2048, 768, device="cuda").to(torch.bfloat16).mT
    if not transposed:
        x = x.contiguous()
    x = x / 64
    gram = torch.bmm(x, x.mT)
    poly = torch.baddbmm(gram, gram, gram, beta=-2.77, alpha=0.506)
    out = poisoned(x.shape, torch.bfloat16, "cuda")
    poly_apply_module._launch(poly, x, out, 3.8917, config)
    _check_apply(out, poly, x, 3.8917)


# --- the persistent TMA kernels: which layouts get them (any machine), results (GPU) -----


class _Chosen(Exception):
    """Raised by a stand-in tuner: the launcher's choice is read, no kernel runs."""


def _offered(monkeypatch, fn, *args, **kwargs):
    """(key, configs) that ``fn`` hands the tuner."""

    def choose(kernel, key, configs, interpreter_config, device, bench, force=False):
        raise _Chosen(key, configs)

    monkeypatch.setattr(_launch.TUNER, "choose", choose)
    with pytest.raises(_Chosen) as caught:
        fn(*args, **kwargs)
    return caught.value.args


@pytest.mark.parametrize(
    "make,tma",
    [
        (lambda: torch.zeros(5, 40, 64, dtype=torch.bfloat16), True),
        (lambda: torch.zeros(5, 64, 40, dtype=torch.float16).mT, True),  # a .mT view
        (lambda: torch.zeros(5, 40, 72, dtype=torch.bfloat16)[:, :, :60], True),  # padded rows
        (lambda: torch.zeros(5, 40, 60, dtype=torch.bfloat16), False),  # 120-byte rows
        (lambda: torch.zeros(5 * 40 * 64 + 1, dtype=torch.bfloat16)[1:].view(5, 40, 64), False),
        (lambda: torch.zeros(5, 40, 64), False),  # fp32: the pointer kernel only
    ],
    ids=["rows", "mT", "padded", "unaligned-stride", "unaligned-base", "fp32"],
)
def test_tma_configs_offered_by_layout_never_by_batch(monkeypatch, make, tma):
    """TMA configs reach the tuner only for layouts TMA reads, the flag in the key; a matrix
    alone is offered the same configs under the same key as its batch. ``MUON_OFFLOAD_TMA=0``
    and, unset, a CPU tensor: the pointer kernels only."""
    monkeypatch.setenv("MUON_OFFLOAD_TMA", "1")
    # The layout rule alone: these small matrices' candidates are not pruned by their class
    # (shape_classes.fitting, tested in test_kernels_tuning.py).
    for module in (gram_module, poly_apply_module):
        monkeypatch.setattr(module, "fitting", lambda configs, *sizes: tuple(configs))
    x = make()
    assert (_tma.tma_layout(x) is not None) == tma
    for t in (x, x[2:3]):
        key, configs = _offered(monkeypatch, sym_gram, t)
        assert key[-1] is tma and any(c.tma for c in configs) is tma
        assert configs == _offered(monkeypatch, sym_gram, t)[1]
        out = torch.empty(t.shape, dtype=t.dtype)
        poly = torch.zeros(t.shape[0], 40, 48, dtype=t.dtype)[:, :, :40]
        key, configs = _offered(monkeypatch, poly_apply, poly, t, out=out)
        assert key[-1] is tma and any(c.tma for c in configs) is tma
    gram_keys = {_offered(monkeypatch, sym_gram, t)[0] for t in (x, x[2:3], x[1:4])}
    assert len(gram_keys) == 1
    for value in (None, "0"):  # the default on the CPU, and the switch off: pointers only
        if value is None:
            monkeypatch.delenv("MUON_OFFLOAD_TMA")
        else:
            monkeypatch.setenv("MUON_OFFLOAD_TMA", value)
        key, configs = _offered(monkeypatch, sym_gram, x)
        assert key[-1] is False and not any(c.tma for c in configs)


def test_tma_default_follows_the_gpu(monkeypatch):
    """Unset, the TMA configs are offered on GPUs with TMA (compute capability 9.0 and up)
    only, never on the CPU; the switch overrides both ways. (No GPU is touched: the
    capability is the function's only read of the device.)"""
    monkeypatch.delenv("MUON_OFFLOAD_TMA", raising=False)
    gpu = torch.device("cuda", 0)
    for capability, expected in (((9, 0), True), ((10, 0), True), ((8, 9), False)):
        monkeypatch.setattr(_tma, "_capability", lambda index, c=capability: c)
        assert _tma.tma_enabled(gpu) is expected
        monkeypatch.setenv("MUON_OFFLOAD_TMA", "0")
        assert _tma.tma_enabled(gpu) is False
        monkeypatch.setenv("MUON_OFFLOAD_TMA", "1")
        assert _tma.tma_enabled(gpu) is True
        monkeypatch.delenv("MUON_OFFLOAD_TMA")
    assert _tma.tma_enabled(torch.device("cpu")) is False


def test_scale_in_the_tuning_key_never_the_batch(monkeypatch):
    """The folded normalization (``sumsq``) compiles another kernel: its presence is in the
    key, beside TMA's flag (last); the key of a matrix alone is its batch's."""
    x = torch.zeros(5, 40, 64, dtype=torch.bfloat16)
    poly = torch.zeros(5, 40, 40, dtype=torch.bfloat16)
    sumsq = torch.ones(5)
    for fn, args in ((sym_gram, (x,)), (poly_apply, (poly, x))):
        plain = _offered(monkeypatch, fn, *args)[0]
        keys = set()
        for i, j in ((0, 5), (2, 3), (1, 4)):
            part = [a[i:j] for a in args]
            kw = dict(sumsq=sumsq[i:j], norm_scale=1.02, eps=1e-8)
            keys.add(_offered(monkeypatch, fn, *part, **kw)[0])
        assert len(keys) == 1
        (key,) = keys
        assert key[-2] is True and plain[-2] is False
        assert key[:-2] == plain[:-2] and key[-1] == plain[-1]


GRAM_TMA_CONFIGS = [c for c in gram_module.GRAM_CONFIGS if c.tma]
POLY_TMA_CONFIGS = [c for c in poly_apply_module.POLY_APPLY_CONFIGS if c.tma]


@pytest.mark.cuda
@pytest.mark.parametrize(
    "config", [*GRAM_TMA_CONFIGS, gram_module.GRAM_CONFIGS[0]], ids=lambda c: c.label()
)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m,k", [(77, 1000), (200, 2048), (768, 2048)], ids=str)
def test_sym_gram_tma_configs_match_reference(config, transposed, m, k):
    """Each TMA config (and the pointer kernel) forced, bf16, odd sizes and the ``.mT``
    layout: X X^T, then b A + c A A on it, then Gram Newton-Schulz's product with w, a I and
    symmetrize; NaN-poisoned outputs. A matrix alone has the bits it has in a batch of 5."""
    x = bf16_input(5, m, k, transposed, seed=m + k)
    assert _tma.tma_layout(x) is not None
    gram = poisoned((5, m, m), torch.bfloat16, "cuda")
    gram_module._launch(x, x, None, gram, 1.0, 0.0, 0.0, False, config)
    _check_gram(gram, x)
    alone = poisoned((1, m, m), torch.bfloat16, "cuda")
    gram_module._launch(x[3:4], x[3:4], None, alone, 1.0, 0.0, 0.0, False, config)
    assert torch.equal(alone[0], gram[3])

    a = padded(gram[:3])
    assert _tma.tma_layout(a) is not None
    poly = poisoned((3, m, m), torch.bfloat16, "cuda")
    gram_module._launch(a, a, a, poly, 0.506, -2.77, 0.0, False, config)
    _check_gram(poly, a, alpha=0.506, y=a, beta=-2.77)

    w = padded(sym_gram_reference(x[:3], alpha=0.5))
    got = poisoned((3, m, m), torch.bfloat16, "cuda")
    gram_module._launch(a, w, a, got, 0.7, -1.3, 2.5, True, config)
    want = sym_gram_reference(a, w=w, alpha=0.7, y=a, beta=-1.3, diag=2.5).float().cpu()
    assert torch.equal(got, got.mT), "not symmetric bit for bit"
    af, wf = a.float().cpu().abs(), w.float().cpu().abs()
    assert_within_rounding(got, want, 0.7 * (af @ wf.mT) + 1.3 * af + 2.5)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "config",
    [*POLY_TMA_CONFIGS, poly_apply_module.POLY_APPLY_CONFIGS[0]],
    ids=lambda c: c.label(),
)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m,n", [(77, 1000), (200, 2048), (768, 2048)], ids=str)
def test_poly_apply_tma_configs_match_reference(config, transposed, m, n):
    """As for sym_gram: each config forced, bf16, odd sizes, x a ``.mT`` view or not, poly
    with padded rows (or column-major), alpha X and none; a matrix alone equals its batch's."""
    x = bf16_input(5, m, n, transposed, seed=m * n)
    poly = padded(sym_gram_reference(x, alpha=0.8, symmetrize=True))  # bitwise symmetric
    assert _tma.tma_layout(x) is not None and _tma.tma_layout(poly) is not None
    for alpha in (3.8917, 0.0):
        out = poisoned((5, m, n), torch.bfloat16, "cuda")
        poly_apply_module._launch(poly, x, out, alpha, config)
        _check_apply(out, poly, x, alpha)
        alone = poisoned((1, m, n), torch.bfloat16, "cuda")
        poly_apply_module._launch(poly[2:3], x[2:3], alone, alpha, config)
        assert torch.equal(alone[0], out[2])
    if m % 8 == 0:  # poly column-major: read as its transpose
        out = poisoned((5, m, n), torch.bfloat16, "cuda")
        poly_apply_module._launch(poly.mT.contiguous().mT, x, out, -0.5, config)
        _check_apply(out, poly, x, -0.5)


@pytest.mark.cuda
@pytest.mark.parametrize("transposed", [False, True])
def test_tuned_products_batch_invariant_with_tma(transposed, monkeypatch):
    """Through the public launchers (the tuner's choice, TMA configs among the candidates):
    a matrix alone (a batch of one, same layout) gets the bits it gets in a batch of 5, on
    the qwen3 expert shape."""
    monkeypatch.setenv("MUON_OFFLOAD_TMA", "1")
    x = bf16_input(5, 768, 2048, transposed, seed=7)
    gram = sym_gram(x)
    assert torch.equal(sym_gram(x[1:2])[0], gram[1])
    poly = sym_gram(gram, alpha=0.506, y=gram, beta=-2.77)
    assert torch.equal(sym_gram(gram[1:2], alpha=0.506, y=gram[1:2], beta=-2.77)[0], poly[1])
    out = poly_apply(poly, x, alpha=3.89)
    assert torch.equal(poly_apply(poly[4:5], x[4:5], alpha=3.89)[0], out[4])


@pytest.mark.cuda
def test_tma_products_captured_in_a_cuda_graph():
    """The TMA kernels' descriptors are host objects passed by value: a launch captures (no
    device allocation, no sync) and a replay reads the buffers' new contents."""
    x = bf16_input(3, 200, 1000, True, seed=8)
    a = padded(torch.empty(3, 200, 200, dtype=torch.bfloat16, device="cuda"))
    p = padded(torch.empty(3, 200, 200, dtype=torch.bfloat16, device="cuda"))
    out = torch.empty(3, 200, 1000, dtype=torch.bfloat16, device="cuda")

    def body():
        gram_module._launch(x, x, None, a, 1.0, 0.0, 0.0, False, GRAM_TMA_CONFIGS[0])
        gram_module._launch(a, a, a, p, 0.506, -2.77, 0.0, False, GRAM_TMA_CONFIGS[0])
        poly_apply_module._launch(p, x, out, 3.89, POLY_TMA_CONFIGS[0])

    body()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    x.copy_(bf16_input(3, 200, 1000, True, seed=9))
    graph.replay()
    got = out.clone()
    body()
    assert torch.equal(got, out)
    _check_apply(out, p, x, 3.89)


# Measured on the H200 (bf16 randn, torch 2.11 / triton 3.6): relative RMS error against
# float64 1.07% for both paths on 16 x 768x2048 and 4 x 2048x768, and the Triton paths'
# outputs bit-identical to cuBLAS's there (same sequential fp32 accumulation); 1.36% for both
# on 3 x 200x300, where the two differ by 0.68% (cuBLAS accumulates in another order). The
# paths with a X + B X on poly_apply differ from cuBLAS by about 0.6% after five iterations
# (the product's rounding flips, 1e-5 alone, grow), with the same error against float64
# (bench/orthogonalize.py, 2026-11-29). Bounds: the update tolerance of test_math (3%), and
# Triton no worse than cuBLAS by more than a fifth.
@pytest.mark.cuda
@pytest.mark.parametrize("products", ["triton", "triton_gram", "triton_apply", "triton_all"])
@pytest.mark.parametrize("shape", [(16, 768, 2048), (4, 2048, 768), (3, 200, 300)], ids=str)
def test_orthogonalize_triton_vs_cublas_bf16(shape, products):
    torch.manual_seed(0)
    u = torch.randn(shape, device="cuda").to(torch.bfloat16)
    tri = orthogonalize_on(u, products=products).double()
    cub = orthogonalize_on(u, products="cublas").double()
    ref = torch.stack([orthogonalize64(m) for m in u[:4]])

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    err_tri, err_cub, diff = rel(tri[:4], ref), rel(cub[:4], ref), rel(tri, cub)
    if products_for(u.mT if shape[1] > shape[2] else u) == products:
        assert torch.equal(orthogonalize(u).double(), tri)  # auto takes this path
    print(f"{shape} {products}: {err_tri:.4f}, cublas {err_cub:.4f} vs f64; between {diff:.4f}")
    assert err_tri < 3e-2 and err_cub < 3e-2
    assert err_tri <= 1.2 * err_cub + 1e-3
