"""What a user of a torch.optim.Optimizer expects: checkpoints, schedulers, param groups,
skipped parameters, and errors raised before anything is touched."""

import inspect
import io
import re
import warnings

import pytest
import torch

from muon_offload import AdamW, Muon
from muon_offload.engine.group_checks import check_grad
from muon_offload.engine.settings import ENGINE_ONLY, Settings, SettingsArgs

SHAPES = [(24, 40), (40, 24), (24, 40), (3, 8, 12), (77,), (5,)]


def _model(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _groups(params):
    return [
        dict(params=params[:4]),
        dict(params=params[4:5], algorithm="adamw"),
        dict(params=params[5:], algorithm="lion"),
    ]


def _set_grads(params, step):
    gen = torch.Generator().manual_seed(500 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _snapshot(opt, params):
    return (
        [p.detach().clone() for p in params],
        {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)},
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    )


def _assert_same(a, b):
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    assert a[1].keys() == b[1].keys()
    for i in a[1]:
        for k in a[1][i]:
            assert torch.equal(a[1][i][k], b[1][i][k])
    assert a[2] == b[2]


@pytest.mark.parametrize(
    "resume_kwargs",
    [
        dict(),
        dict(offload=True, chunk_bytes=3000),
        dict(chunk_bytes=1 << 20, offload=True),
    ],
)
def test_state_dict_round_trip_resumes_bitwise(resume_kwargs):
    params = _model()
    opt = Muon(_groups(params), lr=0.02)
    for s in range(3):
        _set_grads(params, s)
        opt.step()
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
    for s in range(3, 5):
        _set_grads(params, s)
        opt.step()
    uninterrupted = _snapshot(opt, params)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    params2 = [torch.nn.Parameter(t.clone()) for t in ckpt["params"]]
    opt2 = Muon(_groups(params2), lr=0.5, **resume_kwargs)  # lr comes from the checkpoint
    opt2.load_state_dict(ckpt["opt"])
    for s in range(3, 5):
        _set_grads(params2, s)
        opt2.step()
    _assert_same(_snapshot(opt2, params2), uninterrupted)


def test_state_dtype_bf16_state_loads_from_fp32_checkpoint():
    params = _model()
    opt = Muon(_groups(params))
    _set_grads(params, 0)
    opt.step()
    opt2 = Muon(_groups(_model()), state_dtype=torch.bfloat16)
    opt2.load_state_dict(opt.state_dict())
    for p, q in zip(params, opt2.param_groups[0]["params"], strict=False):
        m = opt2.state[q]["momentum"]
        assert m.dtype == torch.bfloat16
        assert torch.equal(m, opt.state[p]["momentum"].to(torch.bfloat16))


def test_lr_scheduler_takes_effect():
    def run(with_scheduler):
        params = _model(1)
        opt = Muon(_groups(params), lr=0.02)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s >= 1 else 1.0)
        for s in range(3):
            _set_grads(params, s)
            before = [p.detach().clone() for p in params]
            opt.step()
            if with_scheduler:
                sched.step()
        return params, before

    params, before = run(True)
    # lr is 0 from the second step on: with decoupled decay lr*wd = 0, nothing moves.
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)
    params, before = run(False)
    assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_add_param_group_after_steps():
    params = _model(2)
    opt = Muon([dict(params=params[:4])])
    _set_grads(params, 0)
    opt.step()
    opt.add_param_group(dict(params=params[4:], algorithm="adamw", lr=1e-3))
    assert opt.param_groups[-1]["mu"] == 0.95 and opt.param_groups[-1]["step"] == 0
    _set_grads(params, 1)
    before = params[4].detach().clone()
    opt.step()
    assert not torch.equal(params[4], before)
    assert set(opt.state[params[4]]) == {"momentum", "variance"}
    assert [g["step"] for g in opt.param_groups] == [2, 1]


def test_add_param_group_rejects_bad_group_and_leaves_groups():
    params = _model(3)
    opt = Muon([dict(params=params[:4])])
    with pytest.raises(ValueError, match="param group 1.*shape \\(77,\\)"):
        opt.add_param_group(dict(params=params[4:5]))  # a vector in a muon group
    assert len(opt.param_groups) == 1


def test_grad_none_is_skipped_and_state_untouched():
    params = _model(4)
    opt = Muon(_groups(params))
    _set_grads(params, 0)
    opt.step()
    params[1].grad = None
    params[4].grad = None
    frozen = {
        i: (params[i].detach().clone(), {k: v.clone() for k, v in opt.state[params[i]].items()})
        for i in (1, 4)
    }
    _set_grads([params[0]], 1)
    opt.step()
    for i, (x, st) in frozen.items():
        assert torch.equal(params[i], x)
        for k, v in st.items():
            assert torch.equal(opt.state[params[i]][k], v)
    assert all(g["step"] == 2 for g in opt.param_groups)


def test_adamw_state_keys_and_zero_grad():
    params = _model(5)[4:]
    opt = AdamW(params)
    _set_grads(params, 0)
    opt.step()
    assert set(opt.state[params[0]]) == {"exp_avg", "exp_avg_sq"}
    opt.zero_grad()
    assert all(p.grad is None for p in params)


BAD_GROUPS = [
    (lambda ps: [dict(params=ps[4:5])], ValueError, r"param group 0.*shape \(77,\)"),
    (lambda ps: [dict(params=ps[:1], algorithm="sgd")], ValueError, "unknown algorithm"),
    (lambda ps: [dict(params=ps[:1], adjust_lr="bogus")], ValueError, "adjust_lr"),
    (lambda ps: [dict(params=ps[:1], lr=-1.0)], ValueError, "lr must be"),
    (lambda ps: [dict(params=ps[:1], mu=-0.5)], ValueError, "mu must be"),
    (lambda ps: [dict(params=ps[:1], weight_decay=-0.1)], ValueError, "weight_decay must be"),
    (lambda ps: [dict(params=ps[4:5], algorithm="adamw", beta1=-0.1)], ValueError, "beta1"),
    (lambda ps: [dict(params=ps[4:5], algorithm="lion", beta2=1.5)], ValueError, "beta2"),
]


@pytest.mark.parametrize("make,exc,match", BAD_GROUPS)
def test_bad_groups_raise_at_construction(make, exc, match):
    with pytest.raises(exc, match=match):
        Muon(make(_model()))


def test_bad_constructor_arguments():
    ps = _model()[:1]
    with pytest.raises(ValueError, match="orthogonalizer"):
        Muon(ps, orthogonalizer="svd")
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon(ps, adjust_lr="bogus")
    with pytest.raises(ValueError, match="chunk_bytes"):
        Muon(ps, chunk_bytes=0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        Muon(ps, offload=True, chunk_bytes=-5)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int, got '1'"):
        Muon(ps, chunk_bytes="1")
    with pytest.raises(ValueError, match="resident_chunk_bytes"):
        Muon(ps, resident_chunk_bytes=0)
    with pytest.raises(ValueError, match="resident_chunk_bytes"):
        AdamW(ps, resident_chunk_bytes=2.5)
    with pytest.raises(ValueError, match="betas"):
        AdamW(ps, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        AdamW(ps, lr=-1e-3)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        AdamW(ps, amsgrad=True)


def test_bad_budgets_change_nothing():
    """``reconfigure`` and an assigned setting are checked as the constructor's are, and a
    refused change keeps every budget as it was."""
    ps = _model()[:1]
    opt = Muon(ps, offload=True, chunk_bytes=4096, resident_chunk_bytes=8192)
    with pytest.raises(ValueError, match="resident_chunk_bytes must be a positive int, got 0"):
        opt.reconfigure(chunk_bytes=1024, resident_chunk_bytes=0)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int, got 2.5"):
        opt.reconfigure(chunk_bytes=2.5)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int, got True"):
        opt.chunk_bytes = True
    with pytest.raises(ValueError, match="cuda_graph must be True, False or 'auto'"):
        opt.cuda_graph = "yes"
    assert (opt.chunk_bytes, opt.resident_chunk_bytes, opt.cuda_graph) == (4096, 8192, "auto")
    opt.reconfigure(chunk_bytes=1024)  # the other budget is kept, not derived afresh
    assert (opt.chunk_bytes, opt.resident_chunk_bytes) == (1024, 8192)


FIXED = [("offload", False), ("state_dtype", torch.int8), ("resident_bytes", 1 << 20)]


@pytest.mark.parametrize(("name", "value"), FIXED)
def test_settings_the_state_is_made_by_are_fixed(name, value):
    """Where state lives and its format are made with the optimizer (dion's Muon makes its
    state at construction too): assigning one raises and says how to change it, rather than
    leave the state as it was under a setting that says otherwise; nothing changes."""
    params = _model()
    opt = Muon(_groups(params), offload=True, chunk_bytes=2000)
    _set_grads(params, 0)
    opt.step()
    before, settings = _snapshot(opt, params), opt._settings.now
    with pytest.raises(AttributeError, match=f"{name} is fixed.*load this one's state_dict"):
        setattr(opt, name, value)
    assert opt._settings.now is settings
    _assert_same(before, _snapshot(opt, params))


DELEGATED = ("host_state_bytes", "host_buffers", "staging_bytes", "timeline", "reconfigure")
DELEGATED += ("prefetch", "graph_stats")


def test_methods_of_the_optimizers_parts_are_its_own():
    """The public members that live on a part of the optimizer (``Delegated``) keep their
    documentation on the class, come bound to this optimizer's part, and a read-only one
    refuses assignment as a property does."""
    params = _model()
    opt, other = Muon(_groups(params), lr=0.02), Muon(_groups(params), lr=0.02)
    for name in DELEGATED:
        doc = getattr(Muon, name).__doc__  # its own, not its kind's (function, property, ...)
        assert doc and doc != type(getattr(Muon, name)).__doc__, name
        member = getattr(opt, name)
        if callable(member):
            assert member.__self__ is not getattr(other, name).__self__, name
    assert opt.graph_stats()["eager_steps"] == 0 and opt.host_buffers() == []
    for name in ("host_state_bytes", "staging_bytes"):
        with pytest.raises(AttributeError):
            setattr(opt, name, 1)
    assert opt.host_state_bytes == 0 and opt.staging_bytes == 0


def test_a_method_of_the_optimizer_refuses_assignment():
    """``opt.prefetch = False`` (the setting's name is the method's) raises and says where
    the setting is given, rather than shadow the method that the backward hooks call; the
    optimizer steps on as before. The other methods refuse as well."""
    params = _model()
    opt = Muon(_groups(params), lr=0.02, offload=True, chunk_bytes=2000)
    for name in DELEGATED:
        if callable(getattr(opt, name)):
            with pytest.raises(AttributeError, match=f"Muon.{name} is a method"):
                setattr(opt, name, False)
    with pytest.raises(AttributeError, match="prefetch is a method.*its setting is the constr"):
        opt.prefetch = False
    for _ in range(2):
        sum(p.square().sum() for p in params).backward()  # the hooks call opt.prefetch
        opt.step()
        opt.zero_grad()
    assert opt.prefetch() is True  # the next step's first loads (at once on the CPU)


# What the engine tells Settings.check of its algorithms: not the user's to set.


@pytest.mark.parametrize("cls", [Muon, AdamW])
def test_settings_in_signature_and_docstring(cls):
    """The engine's settings are the public constructors' keyword arguments, with the defaults
    ``Settings.check`` gives them, each documented; an unknown one is refused."""
    shown = inspect.signature(cls).parameters
    doc = inspect.getdoc(cls)
    for name, setting in inspect.signature(Settings.check).parameters.items():
        if name not in ENGINE_ONLY:
            assert shown[name].kind is inspect.Parameter.KEYWORD_ONLY
            assert shown[name].default == setting.default, name
            assert re.search(rf"^    {name}: ", doc, flags=re.M), name
        else:  # the engine's own: passed by the class, not the user's to give
            assert name not in shown, name
    with pytest.raises(TypeError, match="chunk_size"):
        cls(_model()[:1], chunk_size=1024)
    # What type checkers see (``**settings: Unpack[SettingsArgs]``) names the same settings,
    # with the annotations of Settings.check.
    checked = {
        name: p.annotation
        for name, p in inspect.signature(Settings.check).parameters.items()
        if name not in ENGINE_ONLY
    }
    typed = {k: getattr(v, "__forward_arg__", v) for k, v in SettingsArgs.__annotations__.items()}
    assert typed == checked
    assert "Unpack[SettingsArgs]" in inspect.getsource(cls.__init__)


def _break_grad(kind, params, which):
    p = params[which]
    if kind == "shape":
        # torch refuses to assign a mismatched .grad, but a hook or in-place op can still
        # leave one behind.
        p.grad.resize_(p.shape[0] + 1, *p.shape[1:])
    elif kind == "sparse":
        p.grad = p.grad.to_sparse()
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind,exc", [("shape", ValueError), ("sparse", TypeError)])
@pytest.mark.parametrize("which", [2, 4])
def test_bad_gradient_raises_before_anything_is_touched(kind, exc, which):
    params = _model(6)
    opt = Muon(_groups(params), offload=True, chunk_bytes=2000)
    _set_grads(params, 0)
    opt.step()
    _set_grads(params, 1)
    before = _snapshot(opt, params)
    shape = tuple(params[which].shape)
    _break_grad(kind, params, which)
    with pytest.raises(exc, match=re.escape(f"shape {shape}")):
        opt.step()
    _assert_same(_snapshot(opt, params), before)


def test_complex_parameter_raises_before_anything_is_touched():
    params = _model(6)
    z = torch.nn.Parameter(torch.randn(6, dtype=torch.complex64))
    opt = Muon([dict(params=params[:4]), dict(params=params[4:] + [z], algorithm="adamw")])
    _set_grads(params, 0)
    opt.step()
    _set_grads(params, 1)
    z.grad = torch.randn_like(z)
    before = _snapshot(opt, params)
    with pytest.raises(TypeError, match=r"complex.*|shape \(6,\)"):
        opt.step()
    _assert_same(_snapshot(opt, params), before)


def test_gradient_on_another_device_is_named():
    class Stand:  # torch will not attach a grad on another device, so stand in for one
        shape = torch.Size((3, 4))
        device = torch.device("cpu")
        grad = torch.empty(3, 4, device="meta")
        is_complex = staticmethod(lambda: False)
        is_floating_point = staticmethod(lambda: True)

    with pytest.raises(ValueError, match=r"param group 2 \(parameter of shape \(3, 4\)\).*meta"):
        check_grad(Stand(), 2)


def test_bad_hyperparameter_set_later_raises_at_step_before_anything_is_touched():
    params = _model(7)
    opt = Muon(_groups(params))
    _set_grads(params, 0)
    opt.step()
    before = _snapshot(opt, params)
    opt.param_groups[2]["lr"] = -1.0
    _set_grads(params, 1)
    with pytest.raises(ValueError, match="param group 2"):
        opt.step()
    after = _snapshot(opt, params)
    _assert_same(after[:2] + (before[2],), before)


def test_step_hooks_run_around_the_step():
    params = _model(8)
    opt = Muon(_groups(params), offload=True, chunk_bytes=3000)
    seen = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: seen.append(("pre", o.param_groups[0]["step"]))
    )
    opt.register_step_post_hook(
        lambda o, args, kwargs: seen.append(("post", o.param_groups[0]["step"]))
    )
    _set_grads(params, 0)
    opt.step()
    assert seen == [("pre", 0), ("post", 1)]


def test_add_param_group_offloaded_state_goes_to_host_slabs():
    params = _model(9)
    opt = Muon([dict(params=params[:4])], offload=True, chunk_bytes=3000)
    _set_grads(params, 0)
    opt.step()
    slabs_before = len(opt._store.host.slabs)
    opt.add_param_group(dict(params=params[4:], algorithm="adamw"))
    _set_grads(params, 1)
    opt.step()
    assert len(opt._store.host.slabs) == slabs_before + 1
    new_slab = opt._store.host.slabs[-1]
    lo, hi = new_slab.data_ptr(), new_slab.data_ptr() + new_slab.numel()
    for p in params[4:]:
        for t in opt.state[p].values():
            assert lo <= t.data_ptr() < hi


@pytest.mark.parametrize("offload", [False, True])
def test_empty_parameters_get_state_once(offload):
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(0, 5), (4, 6), (0,), (3,)]]
    opt = Muon(
        [dict(params=params[:2]), dict(params=params[2:], algorithm="adamw")],
        offload=offload,
        chunk_bytes=64,
    )
    for step in range(2):
        _set_grads(params, step)
        opt.step()
    assert all(opt.state[p] for p in params)
    assert set(opt.state[params[2]]) == {"momentum", "variance"}
    assert len(opt._plans) == 1  # state is not re-created (and plans not dropped) every step


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: [dict(params=[ps[0], ps[1], ps[0]])],
        lambda ps: [dict(params=iter([ps[0], ps[0]]))],  # read once: a generator
        lambda ps: [dict(params=ps[:2]), dict(params=ps[1:3])],
        lambda ps: [
            dict(params=ps[:1]),
            dict(params=ps[4:5], algorithm="adamw"),
            dict(params=ps[4]),
        ],
    ],
    ids=["one_group", "generator", "two_groups", "bare_tensor_group"],
)
def test_duplicate_parameter_refused_at_construction(make, offload):
    """A parameter listed twice would be stepped twice a step (torch only warns for one group)."""
    params = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused with our error, not torch's warning first
        with pytest.raises(ValueError, match=r"param group \d \(parameter of shape .*\) is"):
            Muon(make(params), offload=offload)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("twice_in", ["new_group", "old_group"])
def test_add_param_group_refuses_duplicates_before_anything_is_touched(twice_in, offload):
    params = _model(10)
    opt = Muon(_groups(params), offload=offload, chunk_bytes=3000)
    _set_grads(params, 0)
    opt.step()
    before = _snapshot(opt, params)
    extra = torch.nn.Parameter(torch.randn(6))
    group = [extra, extra] if twice_in == "new_group" else [extra, params[5]]
    with pytest.raises(ValueError, match=r"param group 3 \(parameter of shape \(\d+,\)\) is"):
        opt.add_param_group(dict(params=group, algorithm="adamw"))
    assert len(opt.param_groups) == 3 and extra not in opt.state
    _assert_same(_snapshot(opt, params), before)
    _set_grads(params, 1)
    opt.step()  # still steps as before


T = torch.tensor
# AdamW arguments, torch's AdamW's error for each (None: it accepts them).
HYPER_CASES = {
    "lr_negative": dict(lr=-1.0),
    "lr_nan": dict(lr=float("nan")),
    "lr_two_element_tensor": dict(lr=T([1e-3, 1e-3])),
    "lr_list": dict(lr=[1e-3, 1e-3]),
    "lr_string": dict(lr="0.1"),
    "eps_negative": dict(eps=-1.0),
    "weight_decay_negative": dict(weight_decay=-0.1),
    "weight_decay_list": dict(weight_decay=[0.1, 0.1]),
    "beta_one": dict(betas=(1.0, 0.9)),
    "beta_negative": dict(betas=(0.9, -0.5)),
    "betas_tensor_and_float": dict(betas=(T(0.9), 0.99)),
    "betas_two_element_tensors": dict(betas=(T([0.9, 0.9]), T([0.9, 0.9]))),
    "betas_tensors": dict(betas=(T(0.9), T(0.99))),
    "betas_one_tensor": dict(betas=T([0.9, 0.99])),
    "lr_tensor": dict(lr=T(1e-3)),
}


def _error(make):
    try:
        make()
    except Exception as err:  # noqa: BLE001 - which error is what is compared
        return err
    return None


@pytest.mark.parametrize("name", list(HYPER_CASES))
def test_constructor_checks_hyperparameters_as_torch_adamw_does(name):
    """torch's AdamW checks its arguments before it reads ``params``: a ValueError of torch's
    is a ValueError here, raised before ``params`` is read; what torch accepts works here."""
    kwargs = HYPER_CASES[name]
    theirs = _error(lambda: torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], **kwargs))
    if theirs is None:
        p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
        ref, opt = torch.optim.AdamW([p], **kwargs), AdamW([q], **kwargs)
        for o, x in ((ref, p), (opt, q)):
            x.grad = torch.full((3,), 0.5)
            o.step()
        torch.testing.assert_close(q, p)
        return

    def unread():
        raise AssertionError("params read before the hyper-parameters were checked")
        yield

    ours = _error(lambda: AdamW(unread(), **kwargs))
    if isinstance(theirs, ValueError):
        assert isinstance(ours, ValueError), ours
    elif isinstance(theirs, TypeError):  # torch's own: a comparison with a non-number
        assert isinstance(ours, (TypeError, ValueError)) and "params read" not in str(ours), ours
    assert _error(lambda: AdamW([], **kwargs)).args == ours.args  # not the empty list's error


@pytest.mark.parametrize(
    "kwargs",
    [dict(lr=-1.0), dict(mu=-0.5), dict(weight_decay=T([0.1, 0.1])), dict(epsilon=-1.0)],
    ids=["lr", "mu", "weight_decay", "epsilon"],
)
def test_muon_checks_hyperparameters_before_params(kwargs):
    def unread():
        raise AssertionError("params read before the hyper-parameters were checked")
        yield

    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Muon(unread(), **kwargs)
