"""The step's scalar table (muon_offload/engine/scalars.py): the kernels read every runtime
scalar from it, so a captured CUDA graph replays each step's values.

- each value in the table is the fp32 that Triton makes of the Python float the launchers
  passed before (checked through a kernel that stores its float argument: the interpreter
  here, the compiled launcher on a GPU);
- the table holds, bit for bit, adamw_scalars / lion_scalars / Muon's (mu, eps, decay,
  adjusted lr) of each group at each step, through LR and other hyper-parameter changes;
- an engine step on the table equals, bit for bit, the same step on the launchers that take
  Python numbers;
- no launch takes a hyper-parameter by value: the launches' non-tensor arguments are the
  same whatever the learning rate, decay, betas, mu, eps and step count.
"""

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from muon_offload.kernels.elementwise import adamw_scalars, lion_scalars
from muon_offload.kernels.muon import apply_scalars

from muon_offload import AdamW, Muon
from muon_offload.optim.muon_shapes import adjusted_lr

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@triton.jit
def _store_args(out, a, b, c, d):
    tl.store(out, a)
    tl.store(out + 1, b)
    tl.store(out + 2, c)
    tl.store(out + 3, d)


def _every_scalar() -> list[float]:
    """The values the launchers compute, over a spread of hyper-parameters and steps."""
    values = []
    for lr in (1e-3, 3e-4, 0.02, 1.7e-5, 0.1):
        for beta1, beta2 in ((0.9, 0.999), (0.9, 0.95), (0.0, 0.5), (0.99, 0.9999)):
            for step in (1, 2, 3, 10, 1000, 10**6):
                values += adamw_scalars(lr, beta1, beta2, 1e-8, 0.01, step)
            values += lion_scalars(lr, beta1, beta2, 0.1)
        for shape in ((768, 2048), (2048, 768), (5, 3)):
            adj = adjusted_lr(lr, torch.Size(shape), "spectral_norm", False)
            values += apply_scalars(lr, 0.01, adj)
            values += apply_scalars(lr, 0.0, adjusted_lr(lr, torch.Size(shape), "rms_norm", False))
    values += [0.95, 0.9, 0.0, 1e-8, 1e-7, 1.02, 1e-30, 1e30]
    return values


@pytest.mark.parametrize("device", DEVICES)
def test_float_arguments_are_the_tables_fp32(device):
    values = _every_scalar()
    values += [0.0] * (-len(values) % 4)
    out = torch.empty(len(values), dtype=torch.float32, device=device)
    for i in range(0, len(values), 4):
        _store_args[(1,)](out[i:], *values[i : i + 4])
    table = np.array(values, dtype=np.float32)  # what the step's table holds
    assert np.array_equal(out.cpu().numpy().view(np.uint32), table.view(np.uint32))


def _groups(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(24, 40), (40, 24), (24, 40), (77,), (130,), (5,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    groups = [
        dict(params=params[:3]),
        dict(params=params[3:5], algorithm="adamw", lr=3e-3),
        dict(params=params[5:], algorithm="lion", lr=1e-3),
    ]
    return params, groups


def _change(opt, step):
    """An LR schedule, and every other hyper-parameter changed at some step."""
    for group in opt.param_groups:
        group["lr"] = group["lr"] * (0.5 + 0.1 * step)
    if step == 1:
        opt.param_groups[0]["mu"] = 0.9
        opt.param_groups[0]["weight_decay"] = 0.1
        opt.param_groups[1]["beta1"] = 0.8
    if step == 2:
        opt.param_groups[0]["epsilon"] = 1e-6
        opt.param_groups[1]["epsilon"] = 1e-6
        opt.param_groups[2]["beta2"] = 0.9


def _steps(opt, params, steps=4, after=None):
    for s in range(steps):
        gen = torch.Generator().manual_seed(200 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        _change(opt, s)
        opt.step()
        if after is not None:
            after(opt)


def _expected_rows(opt) -> dict:
    """Each (group, shape) row as the launchers compute it from the groups' numbers."""
    rows = {}
    for gi, g in enumerate(opt.param_groups):
        algorithm, step, lr, wd = g["algorithm"], g["step"], g["lr"], g["weight_decay"]
        if algorithm == "adamw":
            rows[gi, None] = adamw_scalars(lr, g["beta1"], g["beta2"], g["epsilon"], wd, step)
        elif algorithm == "lion":
            rows[gi, None] = lion_scalars(lr, g["beta1"], g["beta2"], wd)
        else:
            for p in g["params"]:
                adj = adjusted_lr(lr, p.shape, g["adjust_lr"], g["flatten"])
                rows[gi, tuple(p.shape)] = (g["mu"], g["epsilon"], *apply_scalars(lr, wd, adj))
    return rows


@pytest.mark.parametrize("offload", [False, True])
def test_table_holds_each_steps_scalars_bitwise(offload):
    params, groups = _groups()
    opt = Muon(groups, lr=0.02, backend="triton", offload=offload, chunk_bytes=8000)
    seen = []

    def check(opt):
        table = opt._scalars
        buf = table.buffer.cpu().numpy()
        expected = _expected_rows(opt)
        for (gi, algorithm, shape, _), at in zip(table._rows, table._offsets, strict=True):
            row = algorithm.scalars(opt._read_hyper(opt.param_groups[gi], gi), 1, shape)
            want = expected[gi, shape]
            if algorithm.name == "muon":  # laid out [mu, -, -, -, eps, -, -, -, decay, adj]
                got = buf[[at, at + 4, at + 8, at + 9]]
                assert len(row) == 10
            else:
                got = buf[at : at + len(want)]
            assert np.array_equal(got, np.array(want, dtype=np.float32)), (gi, shape)
            assert at % 4 == 0  # 16-byte aligned rows
        seen.append(len(table._rows))

    _steps(opt, params, after=check)
    assert seen == [4] * 4  # two Muon shapes (24x40 twice), adamw, lion


def _run(params, groups, table: bool, monkeypatch=None, **kw):
    opt = Muon(groups, lr=0.02, backend="triton", **kw)
    if not table:
        from muon_offload.engine import optimizer

        monkeypatch.setattr(optimizer, "scalar_table", lambda *a: None)  # the launchers' numbers
    _steps(opt, params)
    return opt


@pytest.mark.parametrize("kw", [{}, {"offload": True, "chunk_bytes": 8000}])
def test_step_on_the_table_equals_the_step_on_numbers_bitwise(monkeypatch, kw):
    a, groups_a = _groups()
    b, groups_b = _groups()
    opt_a = _run(a, groups_a, True, **kw)
    opt_b = _run(b, groups_b, False, monkeypatch, **kw)
    assert opt_a._scalars is not None and opt_b._scalars is None
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        for k in opt_a.state[p]:
            assert torch.equal(opt_a.state[p][k], opt_b.state[q][k])


def _record_launches(monkeypatch) -> list:
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        # Everything a graph would bake: numbers and flags (tensor contents are read live).
        by_value = [a for a in args if not isinstance(a, torch.Tensor)]
        launches.append((self.__name__, tuple(map(repr, by_value)), repr(sorted(kwargs.items()))))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return launches


@pytest.mark.parametrize("state_dtype", [None, torch.int8])
def test_no_launch_takes_a_hyper_parameter_by_value(monkeypatch, state_dtype):
    # int8 state: matrices and vectors above its 4,096-element minimum.
    gen = torch.Generator().manual_seed(1)
    shapes = [(64, 80), (64, 80), (4500,), (4200,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    groups = [
        dict(params=params[:2]),
        dict(params=params[2:3], algorithm="adamw", lr=3e-3),
        dict(params=params[3:], algorithm="lion", lr=1e-3),
    ]
    opt = Muon(groups, lr=0.02, backend="triton", state_dtype=state_dtype)
    launches = _record_launches(monkeypatch)
    per_step = []
    for s in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        _change(opt, s)
        del launches[:]
        opt.step()
        per_step.append(list(launches))
    assert per_step[0] and per_step[0] == per_step[1] == per_step[2]
    names = {name for name, *_ in per_step[0]}
    # (the normalization runs its kernel on CUDA only: the CPU keeps the torch expression)
    assert {
        "_muon_apply_kernel",
        "_lion_kernel" if state_dtype is None else "_lion8_kernel",
    } <= names


def test_adamw_table_follows_the_step_count():
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(100, generator=gen))]
    opt = AdamW(params, lr=1e-3, backend="triton")
    for step in range(1, 4):
        params[0].grad = torch.randn(100, generator=gen)
        opt.step()
        want = np.array(adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 1e-2, step), dtype=np.float32)
        got = opt._scalars.buffer.cpu().numpy()[:7]
        assert np.array_equal(got, want)
        assert math.isclose(got[5], 1e-3 / (1 - 0.9**step), rel_tol=1e-6)


def test_adamw_rows_follow_each_parameters_count():
    """A parameter that skipped steps has a count of its own, so a unit and a row of its own;
    each row holds adamw_scalars at its parameters' count, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (100, 70, 130)]
    opt = AdamW(params, lr=1e-3, backend="triton")
    for step in range(5):
        for i, p in enumerate(params):
            frozen = i == 1 and step in (1, 2)
            p.grad = None if frozen else torch.randn(p.shape, generator=gen)
        opt.step()
    counts = [int(c["step"]) for c in opt.state_dict()["state"].values()]
    assert counts == [5, 3, 5]
    table = opt._scalars
    buf = table.buffer.cpu().numpy()
    assert len(table._rows) == 2  # one a count
    for (_, _, _, item), at in zip(table._rows, table._offsets, strict=True):
        want = adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 1e-2, counts[item])
        assert np.array_equal(buf[at : at + 7], np.array(want, dtype=np.float32))
