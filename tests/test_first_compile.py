"""The engine's first-compile hook (engine/first_compile.py): before a step whose plan holds
units of kinds this process has not run, one scratch unit of each new kind runs inside
``precompile.compiling_ahead``. On the CPU the block is the real one, told that the CPU is a
GPU (``precompile.enabled``): the interpreted kernels are no JITFunctions, so inside the block
they run on the scratch tensors instead of compiling, which lets the tests see every scratch
unit (its launches, its tensors) and check that the step's results are those of a step
without the pass, bit for bit. On a GPU, fresh-cache first steps: nothing compiled outside the
pool."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from muon_offload.kernels import _launch, precompile
from test_precompile import COMPILE_SPY, _no_process

from muon_offload import Muon
from muon_offload.engine import first_compile

pytest.importorskip("triton.runtime._async_compile")
CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU
# The scratch units run here on zeroed tensors (on a GPU their launches only compile): 0 / 0.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """``compiling_ahead`` on for the CPU (the switch still read), and a process that has run
    no unit yet. No worker processes start (the block's, nor ``prestart``'s at construction):
    the interpreted kernels are no JITFunctions, so no compile job reaches them, and each
    would import Triton, torch and every kernel module (seconds per process, per block)."""
    monkeypatch.setattr(precompile.Workers, "_start", _no_process)
    enabled = precompile.enabled
    monkeypatch.setattr(precompile, "enabled", lambda device: enabled(CUDA))
    monkeypatch.setattr(precompile, "interpreted", lambda: False)
    monkeypatch.delenv(precompile.ENV, raising=False)
    monkeypatch.setattr(first_compile, "_SEEN", set())
    monkeypatch.setattr(first_compile, "_WARNED", [False])


SHAPES = [(33, 17), (33, 17), (3, 9, 5), (64, 80)]  # (64, 80): 8-bit with int8 state


def _model(seed: int = 0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    mats = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    rest = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (40, 4100)]
    # 4 bytes into its storage: not 16-byte aligned, a launch (a variant) of its own
    rest.append(torch.nn.Parameter(torch.randn(301, generator=gen)[1:]))
    for p in mats + rest:
        p.grad = torch.randn(p.shape, generator=gen)
    return mats + rest, [dict(params=mats), dict(params=rest, algorithm="adamw")]


def _spy(opt) -> list[tuple[bool, object, object]]:
    """(inside the block, the algorithm, the job) of every unit update of ``opt``."""
    calls = []
    for algorithm in opt.algorithms.values():

        def update(job, algorithm=algorithm, original=algorithm.update):
            calls.append((_launch.launches_only_compile(), algorithm, job))
            return original(job)

        algorithm.update = update
    return calls


def _signature(algorithm, job) -> tuple:
    """What a unit's launches are read off: its algorithm, format and each tensor's layout."""
    lists = [job.params, job.grads, *job.state]
    specs = tuple(
        tuple((tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % 16) for t in ts) for ts in lists
    )
    return algorithm.name, job.fmt, specs


def _storages(opt, params) -> set[int]:
    tensors = [*params, *(p.grad for p in params)]
    tensors += [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors}


def _results(opt, params) -> list[torch.Tensor]:
    state = [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in params] + [t.clone() for t in state]


def _bitwise(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.view(-1), y.view(-1)) for x, y in zip(a, b, strict=True)
    )


def _step(seed=0, shapes=SHAPES, **kw):
    params, groups = _model(seed, shapes)
    opt = Muon(groups, lr=0.02, backend="triton", **kw)
    calls = _spy(opt)
    opt.step()
    return params, opt, calls


KWARGS = [
    dict(),
    dict(state_dtype=torch.int8),
    dict(offload=True, chunk_bytes=6000),
]


@pytest.mark.parametrize("kw", KWARGS, ids=["resident", "int8", "offload"])
def test_the_first_step_runs_one_scratch_unit_of_each_new_kind_ahead(as_on_a_gpu, kw):
    params, opt, calls = _step(**kw)
    ahead = [(a, job) for inside, a, job in calls if inside]
    real = [(a, job) for inside, a, job in calls if not inside]
    # One scratch unit a kind of the step's units, each laid out as its unit is (the staging
    # views of an offloaded chunk included): the same launches, so the same variants.
    assert sorted(map(repr, {_signature(*c) for c in real})) == sorted(
        repr(_signature(*c)) for c in ahead
    )
    users = _storages(opt, params)
    for _, job in ahead:
        for t in [*job.params, *job.grads, *(t for ts in job.state for t in ts)]:
            assert t.untyped_storage().data_ptr() not in users
    # The same bits as without the pass.
    plain_params, plain_opt, plain_calls = _step(**kw)
    assert not any(inside for inside, *_ in plain_calls)  # every kind seen: no pass
    assert _bitwise(_results(opt, params), _results(plain_opt, plain_params))
    # Never again for a seen kind: the next step, another optimizer over the same shapes.
    calls.clear()
    opt.step()
    assert calls and not any(inside for inside, *_ in calls)


def test_only_the_new_kinds_of_a_later_plan_run_ahead(as_on_a_gpu):
    _step()
    _, _, calls = _step(seed=1, shapes=[(33, 17), (20, 12), (33, 17)])
    ahead = [(a.name, tuple(job.params[0].shape)) for inside, a, job in calls if inside]
    assert ahead == [("muon", (20, 12))]  # the batch of two (33, 17) and the AdamW unit: seen


def test_the_switch_turns_the_pass_off(as_on_a_gpu, monkeypatch):
    monkeypatch.setenv(precompile.ENV, "0")
    _, _, calls = _step()
    assert calls and not any(inside for inside, *_ in calls)
    assert not first_compile._SEEN


def test_without_cuda_nothing_runs_ahead(monkeypatch):
    monkeypatch.setattr(first_compile, "_SEEN", set())
    _, _, calls = _step()
    assert calls and not any(inside for inside, *_ in calls)


@pytest.mark.parametrize("where", ["unit", "block"])
def test_a_failing_pass_is_a_warning_once_and_changes_no_result(
    as_on_a_gpu, monkeypatch, caplog, where
):
    plain_params, plain_opt, _ = _step()
    monkeypatch.setattr(first_compile, "_SEEN", set())

    def fail(*args, **kwargs):
        raise RuntimeError("no compile today")

    if where == "block":
        monkeypatch.setattr(precompile, "compiling_ahead", fail)
    params, groups = _model()
    opt = Muon(groups, lr=0.02, backend="triton")
    if where == "unit":  # the second scratch unit fails, after the first ran
        runs, original = [], first_compile._run

        def run(unit, job):
            runs.append(unit)
            return fail() if len(runs) > 1 else original(unit, job)

        monkeypatch.setattr(first_compile, "_run", run)
    with caplog.at_level(logging.WARNING, logger="muon_offload"):
        opt.step()
        _step(seed=1, shapes=[(20, 12)])  # another pass, failing too: no second warning
    warnings = [r for r in caplog.records if "compiling the step's new kernels" in r.message]
    assert len(warnings) == 1 and "no compile today" in warnings[0].message
    assert _bitwise(_results(opt, params), _results(plain_opt, plain_params))


class _LeavesEveryKey:
    """A tuner with no decision cached, as on a GPU without a table: inside the first block of
    ``compile_then_tune`` each launcher's ``choices`` gives no config (the key is left to time
    after the block, ``AHEAD.pending``), after it the one the timing picked (here the
    interpreter's)."""

    def __init__(self) -> None:
        self.left: set = set()

    def choose(self, kernel, key, configs, interpreter_config, device, bench, force=False):
        return interpreter_config

    def choices(self, kernel, key, configs, interpreter_config, device, bench):
        pending = getattr(_launch.AHEAD, "pending", None)
        if pending is not None and (kernel, key) not in self.left:
            self.left.add((kernel, key))
            pending.append((kernel, key, tuple(configs), interpreter_config, device, bench))
            return ()
        return (interpreter_config,)


def test_every_launcher_runs_in_a_first_block_that_chose_no_config(
    as_on_a_gpu, monkeypatch, caplog
):
    """Every tuned launcher these steps reach (Muon's prep, dense and 8-bit, and apply; AdamW:
    the products of matrices this small take their one smallest tile untimed, and
    test_precompile's launcher tests cover theirs) launches nothing for a key left to time,
    and what follows its launches must not need them (found on the H200: the 8-bit prep's row
    sum read a partial sum made only by a launch). The pass then ends without a warning, and
    the step's results are those of a step without it. With int8 state the small tensors
    keep fp32 state (under 4,096 elements): one step reaches both families."""
    kw = dict(state_dtype=torch.int8)
    from muon_offload.kernels import (
        elementwise,
        gram,
        muon,
        normalize,
        poly_apply,
        quantized_elementwise,
        quantized_muon,
    )

    plain_params, plain_opt, _ = _step(**kw)
    monkeypatch.setattr(first_compile, "_SEEN", set())
    tuner = _LeavesEveryKey()
    for module in (elementwise, gram, muon, normalize, poly_apply, quantized_elementwise):
        monkeypatch.setattr(module, "TUNER", tuner)
    monkeypatch.setattr(quantized_muon, "TUNER", tuner)
    with caplog.at_level(logging.WARNING, logger="muon_offload"):
        params, opt, calls = _step(**kw)
    assert not [r for r in caplog.records if "compiling the step's new kernels" in r.message]
    left = {kernel for kernel, _ in tuner.left}
    assert any(inside for inside, *_ in calls)
    assert {"muon_prep", "muon_prep8", "muon_apply", "adamw"} <= left
    assert _bitwise(_results(opt, params), _results(plain_opt, plain_params))


def test_the_pass_leaves_the_random_state_as_it_was(as_on_a_gpu, monkeypatch):
    original = first_compile._run

    def run(unit, job):  # draws, as a tuner's scratch (``scratch_like``) does
        torch.rand(1)
        return original(unit, job)

    monkeypatch.setattr(first_compile, "_run", run)
    torch.manual_seed(5)
    _, _, calls = _step()
    assert any(inside for inside, *_ in calls)
    after_the_pass = torch.rand(3)
    torch.manual_seed(5)
    _step()  # every kind seen: no pass
    assert torch.equal(after_the_pass, torch.rand(3))


def test_a_users_orthogonalizer_is_never_called_on_scratch(as_on_a_gpu):
    inside = []

    def orthogonalize(u, epsilon):  # may keep state: called on the user's matrices alone
        inside.append(_launch.launches_only_compile())
        return u

    _, groups = _model()
    opt = Muon(groups, lr=0.02, backend="triton", orthogonalizer=orthogonalize)
    calls = _spy(opt)
    opt.step()
    assert inside and not any(inside)
    ahead = {a.name for inside, a, _ in calls if inside}
    assert ahead == {"adamw"}  # the element-wise units still run ahead


_FIRST_STEPS = COMPILE_SPY + textwrap.dedent(
    """

    kw = json.loads(sys.argv[1])
    if kw.pop("int8", False):  # 8-bit from 4,096 elements: the small AdamW tensors stay fp32
        kw["state_dtype"] = torch.int8
    if kw.pop("no_table", False):  # every key timed, as on a GPU the package has no table for
        from muon_offload.kernels import _launch
        _launch.TUNER._shipped.choice = lambda *args, **kwargs: None
    gen = torch.Generator().manual_seed(0)
    shapes = [(1000, 333), (1000, 333), (17, 4097), (4, 64, 96), (512, 1024)]
    shapes = [tuple(s) for s in kw.pop("shapes", shapes)]
    mats = [torch.randn(s, generator=gen) for s in shapes]
    rest = [torch.randn(n, generator=gen) for n in (1000, 333, 5000)]
    params = [torch.nn.Parameter(t.cuda()) for t in mats + rest]
    m = len(mats)
    groups = [dict(params=params[:m]), dict(params=params[m:], algorithm="adamw", lr=1e-3)]
    opt = Muon(groups, lr=0.02, **kw)
    per_step = []
    for step in range(2):
        for p in params:  # fresh gradients, as backward makes them
            p.grad = torch.randn(p.shape, generator=gen).cuda()
        opt.step()
        torch.cuda.synchronize()
        per_step.append(len(compiles))
    print(json.dumps(dict(
        compiles=compiles, jobs=jobs, per_step=per_step,
        params=[p.detach().cpu().double().flatten().tolist()[:4000] for p in params],
    )))
    """
)


def _first_steps(tmp_path, name: str, kw: dict, switch: str, tune: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / f"triton-{name}")  # a fresh machine's caches
    env["MUON_OFFLOAD_CACHE_DIR"] = str(tmp_path / f"tune-{name}")
    env[precompile.ENV] = switch
    if not tune:
        env["MUON_OFFLOAD_AUTOTUNE"] = "0"  # the same configs in every run, none timed
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_STEPS, json.dumps(kw)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["stderr"] = done.stderr[-3000:]  # the pass's warning, if it failed
    return out


MODELS = [dict(), dict(int8=True, offload=True, chunk_bytes=1 << 20)]


@pytest.mark.cuda
@pytest.mark.parametrize("kw", MODELS, ids=["dense-resident", "int8-offload"])
def test_a_fresh_machines_first_step_compiles_its_kernels_on_the_pool(tmp_path, kw):
    """Muon (2-D, a 3-D stack), AdamW, dense or 8-bit state: the step's own launches find
    every variant compiled by the pass before it, the same variants as a step without the
    pass compiles itself, and the same bits."""
    on = _first_steps(tmp_path, "on", kw, "1", tune=False)
    off = _first_steps(tmp_path, "off", kw, "0", tune=False)
    assert on["compiles"], "nothing was compiled"
    outside = [t for t in on["compiles"] if not t.startswith("muon-offload-load")]
    assert not outside, f"{len(outside)} variants compiled outside the pool: {on['stderr']}"
    assert len(on["jobs"]) == len(on["compiles"])  # each first compiled in a worker process
    assert on["per_step"][0] == on["per_step"][1]  # the second step compiles nothing
    assert len(off["compiles"]) == len(on["compiles"])  # the variants the step needs, no more
    assert on["params"] == off["params"]


@pytest.mark.cuda
@pytest.mark.parametrize(
    "shapes",
    [[(1024, 512), (1024, 512), (48, 256, 512), (512, 1024)], None],
    ids=["multiples-of-16", "odd-sizes"],
)
def test_a_first_step_that_tunes_finds_every_candidate_compiled(tmp_path, shapes):
    """Tuning on, an empty tuning cache and no shipped table: every key is timed in the pass
    (``precompile.compile_then_tune``), on candidates its first block compiled, and the
    winner's own launch (the step's sizes and alignment, what the timing leaves out: the fused
    apply of the last product) is compiled in its second: nothing compiles outside the pool,
    nor in the second step."""
    kw = dict(MODELS[1], no_table=True)
    if shapes is not None:  # None: the script's own, odd sizes among them
        kw["shapes"] = shapes
    on = _first_steps(tmp_path, "tune", kw, "1", tune=True)
    outside = [t for t in on["compiles"] if not t.startswith("muon-offload-load")]
    assert on["compiles"], "nothing was compiled"
    assert not outside, f"{len(outside)} variants compiled outside the pool: {on['stderr']}"
    assert on["per_step"][0] == on["per_step"][1]  # the second step compiles nothing


def test_an_optimizer_on_the_triton_path_starts_the_compile_workers_at_construction(
    monkeypatch,
):
    """The workers of its first step's pass start while the caller goes on (their
    interpreters and imports off the first step); not where the step takes torch's path."""
    started = []
    monkeypatch.setattr(precompile, "prestart", started.append)
    _, groups = _model()
    Muon(groups, lr=0.02, backend="triton")
    assert started == [torch.device("cpu")]
    _, groups = _model()
    Muon(groups, lr=0.02, backend="torch")
    assert started == [torch.device("cpu")]
