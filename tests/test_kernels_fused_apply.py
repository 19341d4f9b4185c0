"""Muon's apply fused into the orthogonalization's last product (``poly_apply``'s
``apply_to``, ``orthogonalize_apply_``) against the unfused pair, ``orthogonalize_on`` then
``muon_apply_from_`` on copies of the parameters, bit for bit: the same roundings and the same
expression, so nothing but equality is accepted. Under the interpreter ``tl.dot`` on bf16 is
garbage, so the CPU tests take fp32 and fp16 updates (fp32 and bf16 parameters); the GPU
tests bf16 updates, each poly_apply config forced and tuned."""

from __future__ import annotations

import pytest
import torch
from _kernel_utils import padded
from muon_offload.kernels import _launch
from muon_offload.kernels import gram_newton_schulz as gns_module
from muon_offload.kernels import orthogonalize as ortho_module
from muon_offload.kernels import poly_apply as poly_apply_module
from muon_offload.kernels.muon import apply_scalars, muon_apply_from_, param_apply
from muon_offload.kernels.orthogonalize import orthogonalize_apply_, orthogonalize_on
from muon_offload.kernels.poly_apply import poly_apply
from muon_offload.kernels.poly_apply_tma import apply_kernel_args

from muon_offload.optim import muon_launch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
METHODS = ("polar_express", "newton_schulz5", "gram_newton_schulz")
# Wide, tall, odd (partial tiles of the interpreter's 32 x 32): small, ~3 ms a program there.
SHAPES = [(2, 24, 40), (2, 40, 24), (2, 17, 33)]


def _scalars(device) -> torch.Tensor:
    """The apply's (1 - lr wd, adjusted_lr), a nonzero weight decay."""
    return _launch.device_scalars(apply_scalars(0.02, 0.1, 0.05), torch.device(device))


def _case(shape, u_dtype, p_dtype, device, seed):
    """A fresh update [B, rows, cols] of norm far from 1 and a parameter per matrix."""
    gen = torch.Generator().manual_seed(seed)
    batch, rows, cols = shape
    u = (torch.randn(shape, generator=gen) * 3.7).to(u_dtype).to(device)
    params = [torch.randn(rows, cols, generator=gen).to(p_dtype).to(device) for _ in range(batch)]
    return u, params


def _unfused(u, params, scalars, **kw):
    """Copies of params after orthogonalize_on then muon_apply_from_ (the unfused step)."""
    ref = [p.clone() for p in params]
    muon_apply_from_(ref, orthogonalize_on(u, None, **kw), scalars)
    return ref


def _assert_applied_once(got, want, before):
    """Bit for bit the unfused step's, and the step did change the parameters."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"params[{i}]: {(g != w).sum().item()} of {g.numel()} differ"
    assert not any(torch.equal(g, b) for g, b in zip(got, before, strict=True))


@pytest.fixture
def fused_only(monkeypatch):
    """The last product's poly_apply calls, recorded as (wrote out, applied); a fallback to
    the stored result and the apply kernel fails."""
    calls = []

    def recording(module):
        real = module.poly_apply

        def poly_apply_spy(poly, x, **kw):
            calls.append((kw.get("out") is not None, kw.get("apply_to") is not None))
            return real(poly, x, **kw)

        monkeypatch.setattr(module, "poly_apply", poly_apply_spy)

    def fallback(*args, **kwargs):
        raise AssertionError("the fused path fell back to muon_apply_from_")

    recording(ortho_module)
    recording(gns_module)
    monkeypatch.setattr(ortho_module, "muon_apply_from_", fallback)
    return calls


# --- CPU (interpreter): fused against unfused ----------------------------------------------


# Every method with every shape; the (update, parameter) dtype pairs rotate through them, so
# that each method and each shape meets both update and both parameter dtypes and every pair of
# dtypes comes up (all pairs of factors covered: 9 cases instead of the 36 of the full product,
# whose interpreted products took 41 s of the CPU suite).
DTYPE_PAIRS = [(F32, F32), (F32, BF16), (F16, F32), (F16, BF16)]
FUSED_CASES = [
    (method, shape, *DTYPE_PAIRS[(i + j) % len(DTYPE_PAIRS)])
    for i, method in enumerate(METHODS)
    for j, shape in enumerate(SHAPES)
]


@pytest.mark.parametrize(("method", "shape", "u_dtype", "p_dtype"), FUSED_CASES, ids=str)
def test_fused_equals_unfused(method, shape, u_dtype, p_dtype, fused_only):
    """Every method on the products' Triton path (Polar Express and Newton-Schulz5 on fp32:
    the folded normalization; on fp16: normalize first; Gram Newton-Schulz: its own Q X),
    wide and tall: the apply in the last poly_apply, which writes no out, and the bits of
    the unfused step."""
    u, params = _case(shape, u_dtype, p_dtype, "cpu", seed=sum(shape))
    scalars, before, u_before = _scalars("cpu"), [p.clone() for p in params], u.clone()
    want = _unfused(u, params, scalars, method=method, products="triton_all")
    fused_only.clear()
    orthogonalize_apply_(u, None, params, scalars, method=method, products="triton_all")
    _assert_applied_once(params, want, before)
    assert fused_only[-1] == (False, True)  # the last product: no out, the apply
    assert not any(applied for _, applied in fused_only[:-1])
    assert torch.equal(u, u_before)


@pytest.mark.parametrize("method", ["polar_express", "gram_newton_schulz"])
def test_fused_with_only_the_apply_on_triton(method, fused_only):
    """ "triton_apply": normalize first, the symmetric products on torch, the apply fused."""
    u, params = _case((2, 40, 24), F32, F32, "cpu", seed=3)
    scalars, before = _scalars("cpu"), [p.clone() for p in params]
    sumsq = u.double().square().sum(dim=(1, 2)).float()
    ref = [p.clone() for p in params]
    kw = dict(method=method, eps=1e-3, products="triton_apply")
    muon_apply_from_(ref, orthogonalize_on(u, sumsq, **kw), scalars)
    orthogonalize_apply_(u, sumsq, params, scalars, **kw)
    _assert_applied_once(params, ref, before)
    assert fused_only[-1] == (False, True)


def _callable_orthogonalizer(u, epsilon):
    return orthogonalize_on(u, None, eps=epsilon, products="cublas")


@pytest.mark.parametrize(
    "method,shape,products",
    [
        ("polar_express", (2, 24, 40), "cublas"),
        ("polar_express", (2, 40, 24), "triton"),  # the last product on torch
        ("gram_newton_schulz", (2, 24, 24), "triton_all"),  # square: the iteration on X
        ("gram_newton_schulz", (2, 40, 24), "auto"),  # the CPU's torch expressions
        (_callable_orthogonalizer, (2, 17, 33), "auto"),
    ],
    ids=["cublas", "triton", "gram_square", "gram_auto", "callable"],
)
def test_fallback_equals_unfused(method, shape, products, monkeypatch):
    """Where the last product is not poly_apply's: orthogonalize, then the apply kernel once."""
    u, params = _case(shape, F32, BF16, "cpu", seed=7)
    scalars, before = _scalars("cpu"), [p.clone() for p in params]
    want = _unfused(u, params, scalars, method=method, products=products)
    applied = []

    def counting(*args):
        applied.append(1)
        return muon_apply_from_(*args)

    monkeypatch.setattr(ortho_module, "muon_apply_from_", counting)
    orthogonalize_apply_(u, None, params, scalars, method=method, products=products)
    _assert_applied_once(params, want, before)
    assert len(applied) == 1


# --- poly_apply's apply_to --------------------------------------------------------------


def _symmetric(batch, m, dtype, gen):
    a = torch.randn(batch, m, m, generator=gen) / m
    return (a + a.mT).to(dtype)


@pytest.mark.parametrize(
    "x_dtype,out_dtype,x_t,param_t,scaled,m,n",
    [
        (F32, F32, False, False, False, 33, 45),
        (F32, F32, True, True, True, 33, 45),  # x a .mT view, parameters [N, M], scaled
        (F16, F16, True, False, False, 33, 45),
        (F16, BF16, False, True, False, 33, 45),  # Gram Newton-Schulz's: another rounding
        (F32, F32, False, True, False, 32, 64),  # whole tiles: the unmasked epilogue
        (F16, BF16, True, False, True, 64, 32),
    ],
    ids=str,
)
def test_poly_apply_to_params(x_dtype, out_dtype, x_t, param_t, scaled, m, n):
    """``poly_apply(apply_to=...)`` returns None and applies what ``out`` would hold: the
    product's (r, c) is the parameter's (r, c), or (c, r) for ``.mT`` (tall updates)."""
    gen = torch.Generator().manual_seed(11)
    batch = 3
    x = torch.randn((batch, n, m) if x_t else (batch, m, n), generator=gen).to(x_dtype)
    x = x.mT if x_t else x
    poly = _symmetric(batch, m, x_dtype, gen)
    scale = {}
    if scaled:
        sumsq = x.double().square().sum(dim=(1, 2)).float()
        scale = dict(sumsq=sumsq, norm_scale=1.02, eps=1e-8)
    p_shape = (n, m) if param_t else (m, n)
    params = [torch.randn(p_shape, generator=gen).to(BF16) for _ in range(batch)]
    scalars, before = _scalars("cpu"), [p.clone() for p in params]
    out = poly_apply(poly, x, alpha=2.5, out_dtype=out_dtype, **scale)
    want = [p.clone() for p in params]
    muon_apply_from_(want, out.mT if param_t else out, scalars)
    apply_to = param_apply(params, p_shape[1], scalars)
    apply_to = apply_to.mT if param_t else apply_to
    got = poly_apply(poly, x, alpha=2.5, out_dtype=out_dtype, apply_to=apply_to, **scale)
    assert got is None
    _assert_applied_once(params, want, before)


def test_apply_to_takes_no_out():
    x = torch.randn(1, 4, 6)
    params = [torch.randn(4, 6)]
    apply_to = param_apply(params, 6, _scalars("cpu"))
    with pytest.raises(ValueError, match="out"):
        poly_apply(torch.randn(1, 4, 4), x, out=torch.empty(1, 4, 6), apply_to=apply_to)
    with pytest.raises(ValueError, match="table"):
        poly_apply(torch.randn(2, 4, 4), torch.randn(2, 4, 6), apply_to=apply_to)


def test_placeholders_without_apply():
    """Without apply_to, the kernels get APPLY off and unread placeholders."""
    x = torch.randn(1, 4, 6)
    args = apply_kernel_args(None, None, x)
    assert args.constexprs["APPLY"] is False and args.args[0] is x


# --- tuning and validation ----------------------------------------------------------------


def test_tuning_never_applies_to_the_parameters(monkeypatch):
    """A tuner that times every candidate (twice each, as on a GPU): the parameters still get
    the step once, and the fused launch asks for the unfused launch's decision (its key: the
    config sets the order of the sums, so the bits)."""
    # 80 columns: the apply's products span more than one smallest tile, so they are timed
    # (a product one tile covers hands the tuner no bench: shape_classes.worth_timing).
    u, params = _case((2, 24, 80), F32, F32, "cpu", seed=5)
    scalars, before = _scalars("cpu"), [p.clone() for p in params]
    keys, timed = [], []

    class TimingTuner:
        def choose(self, kernel, key, configs, interpreter_config, device, bench, force=False):
            keys.append(key)
            if bench is not None:
                timed.append(kernel)
                bench(interpreter_config)
                bench(interpreter_config)
            return interpreter_config

        def choices(self, *args):  # outside a compile pass: the one config choose picks
            return (self.choose(*args),)

    monkeypatch.setattr(poly_apply_module, "TUNER", TimingTuner())
    monkeypatch.setattr(poly_apply_module, "bench_ms", lambda fn: (fn(), fn(), 1.0)[-1])
    monkeypatch.setattr(poly_apply_module, "tuning_batch", lambda elements: 2)
    want = _unfused(u, params, scalars, products="triton_all")
    unfused_keys = list(keys)
    keys.clear()
    orthogonalize_apply_(u, None, params, scalars, products="triton_all")
    _assert_applied_once(params, want, before)
    assert keys == unfused_keys and len(keys) == 5
    assert "poly_apply" in timed


@pytest.mark.parametrize(
    "change",
    ["count", "numel", "dtype", "contiguous", "scalars", "scalars_dtype", "ndim", "products"],
)
def test_invalid_inputs_raise_before_any_change(change):
    u, params = _case((2, 24, 40), F32, F32, "cpu", seed=9)
    scalars, products = _scalars("cpu"), "triton_all"
    if change == "count":
        params = params[:1]
    elif change == "numel":
        params[1] = torch.randn(24, 41)
    elif change == "dtype":
        params[1] = params[1].to(BF16)
    elif change == "contiguous":
        params[1] = torch.randn(40, 24).mT
    elif change == "scalars":
        scalars = scalars[:1]
    elif change == "scalars_dtype":
        scalars = scalars.double()
    elif change == "ndim":
        u = u[0]
    elif change == "products":
        products = "triton_everything"
    before = [p.clone() for p in params]
    with pytest.raises(ValueError):
        orthogonalize_apply_(u, None, params, scalars, products=products)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_empty_matrices_change_nothing():
    params = [torch.empty(0, 5), torch.empty(0, 5)]
    orthogonalize_apply_(torch.empty(2, 0, 5), None, params, _scalars("cpu"))


# --- the optimizer ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_muon_takes_the_fused_call_for_local_units(backend, monkeypatch):
    """A unit whole on this rank without split_sizes goes through orthogonalize_apply_ (on
    the CPU: its fallback, the torch products), a split one through the unfused pair; the
    step is the one of the unfused route."""
    from muon_offload import Muon

    def run():
        gen = torch.Generator().manual_seed(4)
        shapes = [(24, 40), (40, 24), (40, 24)]
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        split = torch.nn.Parameter(torch.randn(36, 20, generator=gen))
        groups = [dict(params=params), dict(params=[split], split_sizes=(12, 24))]
        opt = Muon(groups, lr=0.02, weight_decay=0.1, backend=backend)
        for _ in range(2):
            for p in (*params, split):
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return [p.detach() for p in (*params, split)]

    real = muon_launch.orthogonalize_apply_
    calls = []

    def unfused(backend, params, update, sumsq, *, method, eps, scalars=None, **hyper):
        ortho = muon_launch.orthogonalize_batch(update, sumsq, method=method, eps=eps)
        muon_launch.muon_apply_(backend, params, ortho, scalars=scalars, **hyper)

    def counting(*args, **kwargs):
        calls.append(len(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(muon_launch, "orthogonalize_apply_", unfused)
    want = run()
    monkeypatch.setattr(muon_launch, "orthogonalize_apply_", counting)
    got = run()
    assert sorted(calls) == [1, 1, 2, 2]  # a 24x40 unit and a 40x24 one, two steps
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


# --- GPU: bf16 ---------------------------------------------------------------------------

CUDA_SHAPES = [(3, 256, 512), (3, 512, 256), (2, 100, 260), (2, 260, 100), (4, 768, 2048)]


@pytest.fixture(scope="module")
def tuning_dir(tmp_path_factory):
    """One empty tuning cache for this module's GPU tests: each key is tuned once."""
    return tmp_path_factory.mktemp("tuning")


@pytest.mark.cuda
@pytest.mark.parametrize("tma", ["0", "1"])
@pytest.mark.parametrize("p_dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("method", METHODS)
def test_fused_equals_unfused_bf16_cuda(method, shape, p_dtype, tma, monkeypatch, tuning_dir):
    """bf16 updates as the optimizer's (products "auto": all on Triton), tuned from an empty
    cache (TMA configs offered or not): the fused step has the unfused step's bits, the
    apply in the last product."""
    monkeypatch.setenv("MUON_OFFLOAD_TMA", tma)
    monkeypatch.setenv("MUON_OFFLOAD_AUTOTUNE", "1")
    monkeypatch.setenv("MUON_OFFLOAD_CACHE_DIR", str(tuning_dir))
    u, params = _case(shape, BF16, p_dtype, "cuda", seed=sum(shape))
    scalars, before = _scalars("cuda"), [p.clone() for p in params]
    want = _unfused(u, params, scalars, method=method)
    calls = []
    real = poly_apply_module.poly_apply

    def spy(poly, x, **kw):
        calls.append(kw.get("apply_to") is not None)
        return real(poly, x, **kw)

    monkeypatch.setattr(ortho_module, "poly_apply", spy)
    monkeypatch.setattr(gns_module, "poly_apply", spy)
    orthogonalize_apply_(u, None, params, scalars, method=method)
    torch.cuda.synchronize()
    _assert_applied_once(params, want, before)
    assert calls[-1]


POLY_CONFIGS = poly_apply_module.POLY_APPLY_CONFIGS


@pytest.mark.cuda
@pytest.mark.parametrize("config", POLY_CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("x_t,param_t", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("m,n", [(77, 1000), (256, 512)], ids=str)
def test_poly_apply_configs_apply_bf16_cuda(config, x_t, param_t, m, n):
    """Each config forced (pointer and TMA kernels; masked and even epilogues), x rows
    contiguous or a ``.mT`` view, parameters as the product or its transpose: the launch
    with the apply equals the launch into out followed by the apply kernel."""
    from muon_offload.kernels import _tma

    gen = torch.Generator().manual_seed(m + n)
    batch = 3
    stored = (batch, n, m) if x_t else (batch, m, n)
    x = padded((torch.randn(stored, generator=gen) / n**0.5).to("cuda", BF16))
    x = x.mT if x_t else x
    poly = padded(_symmetric(batch, m, BF16, gen).cuda())
    if config.tma:
        assert _tma.tma_layout(x) is not None and _tma.tma_layout(poly) is not None
    p_shape = (n, m) if param_t else (m, n)
    params = [torch.randn(p_shape, generator=gen).to("cuda", F32) for _ in range(batch)]
    scalars, before = _scalars("cuda"), [p.clone() for p in params]
    out = torch.empty(batch, m, n, dtype=BF16, device="cuda")
    poly_apply_module._launch(poly, x, out, 3.25, config)
    want = [p.clone() for p in params]
    muon_apply_from_(want, out.mT if param_t else out, scalars)
    apply_to = param_apply(params, p_shape[1], scalars)
    apply_to = apply_to.mT if param_t else apply_to
    apply = apply_kernel_args(apply_to, BF16, x)
    poly_apply_module._launch(poly, x, x, 3.25, config, None, apply)
    torch.cuda.synchronize()
    _assert_applied_once(params, want, before)


@pytest.mark.cuda
@pytest.mark.parametrize("method", METHODS)
def test_muon_step_fused_equals_unfused_cuda(method, monkeypatch):
    """Muon on CUDA (resident, bf16 parameters, wide, tall and a 3-D stack): two steps through
    the fused call have the bits of two through the unfused pair."""
    from muon_offload import Muon

    def run():
        gen = torch.Generator().manual_seed(8)
        shapes = [(256, 768), (768, 256), (300, 500), (2, 128, 384)]
        params = [
            torch.nn.Parameter(torch.randn(s, generator=gen).to("cuda", BF16)) for s in shapes
        ]
        opt = Muon(params, lr=0.02, weight_decay=0.1, orthogonalizer=method)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to("cuda", BF16)
            opt.step()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in params]

    got = run()

    def unfused(backend, params, update, sumsq, *, method, eps, scalars=None, **hyper):
        ortho = muon_launch.orthogonalize_batch(update, sumsq, method=method, eps=eps)
        muon_launch.muon_apply_(backend, params, ortho, scalars=scalars, **hyper)

    monkeypatch.setattr(muon_launch, "orthogonalize_apply_", unfused)
    want = run()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
