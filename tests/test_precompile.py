"""Compiling a step's kernels ahead on a thread pool (kernels/precompile.py): when it is on,
what a launch inside the block does, the pool's compiles, the tuner inside the block; and on a
GPU, a fresh-cache first step whose kernels all compile on the pool, with the same results."""

import contextlib
import importlib
import inspect
import json
import os
import pickle
import pkgutil
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from muon_offload.kernels import _launch, precompile

from muon_offload import kernels

triton = pytest.importorskip("triton")
async_compile = pytest.importorskip("triton.runtime._async_compile")
from triton.runtime.jit import JITFunction  # noqa: E402

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


def _kernel(x, n):  # a JITFunction made from it below (conftest makes @triton.jit interpreted)
    pass


def _no_process(self):
    raise OSError("no process here")  # a job would start it again, fail, and compile here


@pytest.fixture
def compiled_kind(monkeypatch):
    """As on a GPU: not interpreted (the flag is read per call). The block's worker processes
    are not started: nothing here is one of Triton's compile closures (fakes, stand-in
    kernels), so no job reaches them, and each would import Triton, torch and every kernel
    module before the block could close it (seconds per process, per block, on the CPU).

    Every kernel module is imported first, under the variable as conftest set it: ``@triton.jit``
    picks the interpreter or the compiler when its module is imported, so a module first
    imported in a test here (``quantized_muon`` by ``_muon_prep8``) would keep compiled
    kernels for the rest of the process, and a later test's CPU launch of them would look for
    a GPU driver."""
    for info in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{info.name}")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(precompile.ENV, raising=False)
    monkeypatch.setattr(precompile.Workers, "_start", _no_process)


def test_on_only_for_cuda_compiled_kernels_and_unless_switched_off(monkeypatch, compiled_kind):
    assert precompile.enabled(CUDA)
    assert not precompile.enabled(torch.device("cpu"))
    monkeypatch.setenv(precompile.ENV, "0")
    assert not precompile.enabled(CUDA)
    monkeypatch.setenv(precompile.ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not precompile.enabled(CUDA)


def test_off_the_block_changes_nothing(monkeypatch):
    before = JITFunction.run
    with precompile.compiling_ahead(torch.device("cpu")) as ahead:
        assert not ahead and not _launch.launches_only_compile()
        assert JITFunction.run is before


def test_launches_of_this_thread_only_compile_inside_the_block(monkeypatch, compiled_kind):
    seen = []

    def run(self, *args, grid, warmup, **kwargs):  # Triton's, as far as the flag goes
        seen.append((threading.current_thread().name, warmup))

    monkeypatch.setattr(JITFunction, "run", run)
    kernel = JITFunction(_kernel)
    other = threading.Thread(target=lambda: kernel[(1,)](1, 2), name="other")
    with precompile.compiling_ahead(CUDA) as ahead:
        assert ahead and _launch.launches_only_compile()
        kernel[(1,)](1, 2)
        other.start()
        other.join()
    kernel[(1,)](1, 2)
    main = threading.current_thread().name
    assert seen == [(main, True), ("other", False), (main, False)]
    assert JITFunction.run is run  # the wrapper is gone with the block
    assert not _launch.launches_only_compile()


def test_the_pool_compiles_in_parallel_and_the_block_waits_for_every_compile(
    monkeypatch, compiled_kind
):
    """Fake compiles submitted as Triton's jit submits them: two must run at once (a barrier
    of two), and each is finalized, on the caller's thread, before the block ends."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    barrier = threading.Barrier(2, timeout=30)
    threads, finalized = set(), []

    def compile_one(i):
        threads.add(threading.current_thread().name)
        barrier.wait()  # raises BrokenBarrierError when the compiles run one at a time
        return f"binary {i}"

    with precompile.compiling_ahead(CUDA):
        mode = async_compile.active_mode.get()
        # triton 3.6 submits (key, compile, finalize), later ones add a cleanup on failure
        cleanup = () if "cleanup_fn" not in inspect.signature(mode.submit).parameters else (id,)
        for i in range(4):
            mode.submit(i, lambda i=i: compile_one(i), finalized.append, *cleanup)
    assert sorted(finalized) == [f"binary {i}" for i in range(4)]
    assert len(threads) >= 2 and all(t.startswith("muon-offload-load") for t in threads)
    assert async_compile.active_mode.get() is None


class _Compiled:
    """A compiled kernel as Triton's compile returns it, as far as its launcher reads it."""

    def __init__(self, i: int, signature: dict) -> None:
        self.src = type("Source", (), {"signature": signature})()
        self.metadata = type("Metadata", (), {"tensordesc_meta": None})()
        self.i = i


def test_each_compiled_kernel_has_its_launcher_made_on_a_load_thread_before_the_block_ends(
    monkeypatch, compiled_kind, caplog
):
    """Triton 3.6 builds a kernel's C launcher (gcc) at its first launch, one after another in
    the step: inside the block each compiled kernel's launcher is made (the driver's launcher
    class, on the kernel's source and metadata) on the pool's threads, two of other signatures
    at once (a barrier of two), before the block ends; a compile's other results are left
    alone, and a launcher that fails is one warning: the kernel is still finalized."""
    from muon_offload.kernels import _launchers

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(_launchers, "_WARNED", [False])
    barrier = threading.Barrier(2, timeout=30)
    made = []

    class Launcher:
        def __init__(self, src, metadata):
            name = src.signature["x"]
            if name in ("*fp32", "*bf16"):
                barrier.wait()  # raises BrokenBarrierError when made one at a time
            if name == "*fp16":
                raise RuntimeError("no C compiler")
            made.append((name, threading.current_thread().name))

    monkeypatch.setattr(_launchers, "launcher_class", lambda: Launcher)
    kernels = [_Compiled(i, {"x": t}) for i, t in enumerate(("*fp32", "*bf16", "*fp16"))]
    finalized = []
    with precompile.compiling_ahead(CUDA) as ahead:
        assert ahead
        mode = async_compile.active_mode.get()
        cleanup = () if "cleanup_fn" not in inspect.signature(mode.submit).parameters else (id,)
        for k in kernels:
            mode.submit(k.i, lambda k=k: k, finalized.append, *cleanup)
        mode.submit("other", lambda: "not a kernel", finalized.append, *cleanup)
    assert sorted(n for n, _ in made) == ["*bf16", "*fp32"]
    assert all(t.startswith("muon-offload-load") for _, t in made)
    assert len(finalized) == 4 and all(k in finalized for k in kernels)
    warned = [r for r in caplog.records if "launcher ahead failed" in r.getMessage()]
    assert len(warned) == 1 and "no C compiler" in warned[0].getMessage()


def test_inside_the_block_the_tuner_compiles_every_candidate_and_decides_nothing(
    monkeypatch, compiled_kind, tmp_path
):
    tuner = _launch.Tuner()
    monkeypatch.setattr(_launch.Tuner, "cache_path", staticmethod(lambda d: tmp_path / "t.json"))
    configs = (_launch.Config(block=64), _launch.Config(block=128))
    benched = []

    def bench(config):
        return _launch.bench_ms(lambda: benched.append(config))  # one call, not timed

    with precompile.compiling_ahead(CUDA):
        got = tuner.choose("k", (1,), configs, configs[0], CUDA, bench)
    assert got == configs[0] and benched == list(configs)
    assert not tuner._chosen and not tuner._memory and not (tmp_path / "t.json").exists()


def test_inside_the_block_only_an_undecided_key_launches_every_candidate(
    monkeypatch, compiled_kind, tmp_path
):
    tuner = _launch.Tuner()
    monkeypatch.setattr(_launch.Tuner, "cache_path", staticmethod(lambda d: tmp_path / "t.json"))
    configs = (_launch.Config(block=64), _launch.Config(block=128))
    timed = tuner.choose("k", ("decided",), configs, configs[0], CUDA, lambda c: -c.block)
    assert timed == configs[1]
    with precompile.compiling_ahead(CUDA):
        bench = lambda c: _launch.bench_ms(lambda: None)  # noqa: E731
        assert tuner.choices("k", ("decided",), configs, configs[0], CUDA, bench) == (timed,)
        assert tuner.choices("k", ("new",), configs, configs[0], CUDA, bench) == configs
    assert tuner.choices("k", ("decided",), configs, configs[0], CUDA, None) == (timed,)


class _OnAGpu:
    """A launcher's tuner, told that its CPU tensors are on a GPU."""

    def __init__(self, tuner) -> None:
        self.tuner = tuner

    def choose(self, kernel, key, configs, interpreter_config, device, bench, force=False):
        return self.tuner.choose(kernel, key, configs, interpreter_config, CUDA, bench, force)

    def choices(self, kernel, key, configs, interpreter_config, device, bench):
        return self.tuner.choices(kernel, key, configs, interpreter_config, CUDA, bench)


def _variants(monkeypatch, module, name: str) -> list[str]:
    """Replace ``module``'s kernel ``name`` by a stand-in that records, for each launch, the
    variant Triton's JIT compiles for it on sm_90 (its binder's specialization of the
    arguments: ints equal to 1 or multiples of 16, pointer alignment, constexprs; and the
    options); nothing runs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = getattr(module, name)
    if not isinstance(kernel, JITFunction):  # interpreted: the same function, compiled kind
        kernel = JITFunction(kernel.fn, do_not_specialize=kernel.kwargs["do_not_specialize"])
    backend = make_backend(GPUTarget("cuda", 90, 32))
    with monkeypatch.context() as env:  # triton 3.9's binder imports gluon, which asks for it
        env.setenv("TRITON_INTERPRET", "1")
        with contextlib.suppress(ImportError):
            import triton.experimental.gluon  # noqa: F401
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    seen: list[str] = []

    class StandIn:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(repr(binder(*args, **kwargs)[1:]))

    monkeypatch.setattr(module, name, StandIn())
    return seen


def _poly_apply_fused():
    from muon_offload.kernels import muon, poly_apply

    params = [torch.zeros(256, 256) for _ in range(2)]  # a class that several tiles fit
    scalars = torch.zeros(2)
    x, poly = (torch.zeros(2, 256, 256, dtype=torch.bfloat16) for _ in range(2))
    apply_to = muon.param_apply(params, 256, scalars)
    return (
        poly_apply,
        "_poly_apply_kernel",
        "poly_apply",
        lambda: poly_apply.poly_apply(
            poly, x, alpha=2.0, out_dtype=torch.bfloat16, apply_to=apply_to
        ),
    )


def _muon_apply_cautious():
    from muon_offload.kernels import muon

    params, u = [torch.zeros(64, 128) for _ in range(2)], torch.zeros(2, 64, 128).bfloat16()
    scalars = torch.zeros(2)
    return (
        muon,
        "_muon_apply_kernel",
        "muon_apply",
        lambda: muon.muon_apply_from_(params, u, scalars, cautious_wd=True),
    )


def _adamw_unaligned():
    from muon_offload.kernels import elementwise

    lists = [[torch.zeros(4100)[1:]] for _ in range(4)]  # 4 bytes into their storage
    scalars = torch.zeros(7)
    return (
        elementwise,
        "_adamw_kernel",
        "adamw",
        lambda: elementwise.adamw_from_(*(tensors for tensors in lists), scalars),
    )


@pytest.mark.parametrize(
    "launcher",
    [_poly_apply_fused, _muon_apply_cautious, _adamw_unaligned],
    ids=["poly_apply-fused-apply", "muon_apply-cautious", "adamw-unaligned"],
)
def test_inside_the_block_a_launch_compiles_the_variant_the_tuning_picks(
    monkeypatch, compiled_kind, tmp_path, launcher
):
    """A key not decided yet is decided in the step, after the pass; the winner's launch
    there is the caller's variant, which the bench's scratch launches need not be (the fused
    apply, ``cautious_wd``, an unaligned segment: found on the H200, where a tuned first step
    compiled the fused apply of the candidates that won in the step). Inside the block the
    launcher compiles its own launch with every candidate, so the step compiles nothing."""
    module, name, kernel, call = launcher()
    tuner = _launch.Tuner()
    monkeypatch.setattr(_launch.Tuner, "cache_path", staticmethod(lambda d: tmp_path / "t.json"))
    monkeypatch.setattr(module, "TUNER", _OnAGpu(tuner))
    times = iter(range(1000, 0, -1))

    def bench_ms(fn):  # each later candidate faster: the last one wins
        fn()
        return float(next(times))

    monkeypatch.setattr(module, "bench_ms", bench_ms)
    launched = _variants(monkeypatch, module, name)
    with precompile.compiling_ahead(CUDA) as ahead:
        assert ahead
        call()
    compiled_ahead = set(launched)
    assert not tuner._chosen  # nothing decided in the block
    launched.clear()
    call()  # the step: the candidates timed, then the winner's launch
    timed = list(tuner.last[kernel]["all_ms"])  # the candidates' labels, in their order
    won = _launch.Config(**tuner.last[kernel]["config"]).label()
    assert timed.index(won) == len(timed) - 1 > 0  # not the first: the block's own launch
    assert launched[-1] in compiled_ahead


_WORKER_ROUND_TRIP = textwrap.dedent(
    """
    import json, os, sys, triton
    from pathlib import Path
    from muon_offload.kernels import precompile, sumsq
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    cache = Path(os.environ["TRITON_CACHE_DIR"])
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 4, "enable_fp_fusion": False})
    signature = {"partial": "*fp32", "out": "*fp32", "groups": "i32"}
    signature |= {"LANES": "constexpr", "LOG2_LANES": "constexpr"}
    src = ASTSource(sumsq._sum_rows_kernel, signature, {"LANES": 1024, "LOG2_LANES": 10}, {})

    def closure(src, target, options):  # as Triton's jit makes it: these names, closed over
        def async_compile():
            return triton.compile(src, target=target, options=options.__dict__)
        return async_compile

    async_compile = closure(src, target, options)
    job = precompile._job(async_compile)
    workers = precompile.Workers(1)
    try:
        reply = workers.submit(job).result(timeout=300)
    finally:
        workers.close()
    written = sorted(p.name for p in cache.iterdir())
    compiled = async_compile()
    print(json.dumps(dict(
        job=list(job[:2]), reply=reply, written=written,
        after=sorted(p.name for p in cache.iterdir()), ptx="ld.global" in compiled.asm["ptx"],
    )))
    """
)


def test_a_worker_compiles_into_the_disk_cache_that_tritons_compile_then_hits(tmp_path):
    """A real variant for sm_90 (no GPU needed), compiled-kind (in a process without the
    interpreter): Triton's compile closure, as its jit makes it, gives its job to a worker
    process, whose binary the closure then finds in the disk cache."""
    pytest.importorskip("triton.backends.nvidia", reason="needs triton's CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _WORKER_ROUND_TRIP],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["job"] == ["muon_offload.kernels.sumsq", "_sum_rows_kernel"]
    assert got["reply"] is None and got["written"], got
    assert got["after"] == got["written"]  # Triton's own compile was a hit: nothing new
    assert got["ptx"]


# A first step's script starts with this: every Triton compile counted by thread, every job
# sent to the worker processes recorded (test_first_compile.py's scripts start with it too).
COMPILE_SPY = textwrap.dedent(
    """
    import json, sys, threading, torch, triton.compiler
    from muon_offload import Muon
    from muon_offload.kernels import precompile

    compiles = []  # "thread: kernel" of each Triton compile (a disk-cache hit counts too)
    real = triton.compiler.compile
    def compile(src, *args, **kwargs):
        kernel = getattr(getattr(src, "fn", None), "__name__", type(src).__name__)
        compiles.append(f"{threading.current_thread().name}: {kernel}")
        return real(src, *args, **kwargs)
    triton.compiler.compile = compile
    jobs = []  # what went to the worker processes
    submit = precompile.Workers.submit
    precompile.Workers.submit = lambda self, job: jobs.append(job[1]) or submit(self, job)
    """
)

_FIRST_STEP = COMPILE_SPY + textwrap.dedent(
    """
    from triton.runtime.jit import JITFunction

    def model():
        gen = torch.Generator().manual_seed(0)
        shapes = [(1000, 333), (17, 4097), (4, 64, 96), (512, 1024)]
        mats = [torch.randn(s, generator=gen) for s in shapes]
        rest = [torch.randn(s, generator=gen) for s in ((1000,), (333,))]
        params = [torch.nn.Parameter(t.cuda()) for t in mats + rest]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).cuda()
        groups = [dict(params=params[:4]), dict(params=params[4:], algorithm="adamw")]
        return params, Muon(groups, lr=0.02)

    params, opt = model()
    if sys.argv[1] == "ahead":
        scratch, scratch_opt = model()  # the same shapes and layouts: the same variants
        with precompile.compiling_ahead(torch.device("cuda"), "test") as ahead:
            assert ahead
            scratch_opt.step()
    ahead_compiles = list(compiles)
    opt.step()
    torch.cuda.synchronize()
    print(json.dumps(dict(
        ahead=ahead_compiles, after=compiles[len(ahead_compiles):], jobs=jobs,
        params=[p.detach().cpu().double().flatten().tolist()[:4000] for p in params],
    )))
    """
)


def _first_step(mode: str, tmp_path) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_CACHE_DIR"] = str(tmp_path / f"triton-{mode}")
    env["MUON_OFFLOAD_CACHE_DIR"] = str(tmp_path / f"tune-{mode}")
    env["MUON_OFFLOAD_AUTOTUNE"] = "0"  # the same configs in both runs, none timed
    # plain: the step compiles its kernels itself (the engine's pass, first_compile.py, off)
    env[precompile.ENV] = "0" if mode == "plain" else "1"
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_STEP, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.cuda
def test_a_fresh_cache_first_step_compiles_on_the_pool_with_the_same_results(tmp_path):
    ahead = _first_step("ahead", tmp_path)
    plain = _first_step("plain", tmp_path)
    assert ahead["ahead"], "nothing was compiled ahead"
    # Triton's own compile ran on the executor's threads (a disk-cache hit after the worker's)
    assert all(t.startswith("muon-offload-load") for t in ahead["ahead"]), ahead["ahead"]
    assert len(ahead["jobs"]) == len(ahead["ahead"])  # each compiled in a worker process
    assert ahead["after"] == [], f"the step compiled {len(ahead['after'])} variants itself"
    assert len(plain["after"]) == len(ahead["ahead"])  # the variants the step needs, no more
    assert ahead["params"] == plain["params"]  # the same binaries: the same bits


def _muon_prep8():
    """8-bit momentum: the row sum's input is shaped by the chosen config (its chunk count),
    which the first block of ``compile_then_tune`` does not choose."""
    from muon_offload.kernels import quantized_muon
    from muon_offload.kernels.quant_maps import QBLOCK

    shape, batch = (64, 1000), 2
    codes = [torch.zeros(shape, dtype=torch.int8) for _ in range(batch)]
    scales = [torch.ones(-(-64000 // QBLOCK)) for _ in range(batch)]
    grads = [torch.zeros(shape) for _ in range(batch)]
    return (
        quantized_muon,
        ("_prep8_kernel", "_row_sum_kernel"),  # the row sum compiled too, but not tracked
        "muon_prep8",
        lambda: quantized_muon.muon_prep8(codes, scales, grads, mu=0.95, nesterov=True),
    )


@pytest.mark.parametrize(
    "launcher",
    [_poly_apply_fused, _muon_apply_cautious, _adamw_unaligned, _muon_prep8],
    ids=["poly_apply-fused-apply", "muon_apply-cautious", "adamw-unaligned", "muon_prep8"],
)
def test_compile_then_tune_times_between_its_blocks_and_compiles_the_winner_only(
    monkeypatch, compiled_kind, tmp_path, launcher
):
    """``compile_then_tune``: the first block compiles the timing launches of a key not
    decided yet and none of the caller's own; the key is timed between the blocks (outside
    either: the card runs the timing) and the second block compiles the winner's own launch
    alone; the step then times nothing and launches a variant compiled ahead."""
    module, name, kernel, call = launcher()
    tuner = _launch.Tuner()
    monkeypatch.setattr(_launch.Tuner, "cache_path", staticmethod(lambda d: tmp_path / "t.json"))
    monkeypatch.setattr(_launch, "TUNER", tuner)
    monkeypatch.setattr(module, "TUNER", _OnAGpu(tuner))
    monkeypatch.setattr(precompile, "_EARLY", [None, True])  # none started early
    times = iter(range(1000, 0, -1))
    timed_inside = []

    def bench_ms(fn):  # each later candidate faster: the last one wins
        fn()
        if _launch.launches_only_compile():
            return float("nan")
        timed_inside.append(_launch.launches_only_compile())
        return float(next(times))

    monkeypatch.setattr(module, "bench_ms", bench_ms)
    name, *untracked = (name,) if isinstance(name, str) else name
    for other in untracked:
        _variants(monkeypatch, module, other)
    launched = _variants(monkeypatch, module, name)
    blocks = []

    def run():
        blocks.append(len(launched))
        call()

    assert precompile.compile_then_tune(CUDA, run, "test")
    parked = precompile._take_early()  # left for the next pass
    assert isinstance(parked, precompile.Workers)
    parked.close()
    assert len(blocks) == 2 and timed_inside and not any(timed_inside)
    first, second = launched[: blocks[1]], launched[blocks[1] :]
    won = _launch.Config(**tuner.last[kernel]["config"])
    timed = list(tuner.last[kernel]["all_ms"])
    assert timed.index(won.label()) == len(timed) - 1 > 0  # the last: not the first config
    # The second block launches the winner's own variant alone: new where the timing's
    # launches differ from the caller's (a fused apply, a flag, the alignment); muon_prep8
    # times the caller's variant itself (compiled in the first block).
    new = set(second) - set(first)
    assert len(set(second)) == 1 and len(new) == (kernel != "muon_prep8")
    launched.clear()
    count = len(timed_inside)
    call()  # the step: decided, so no timing, and its launch compiled ahead
    assert len(timed_inside) == count and set(launched) == set(second)


def test_workers_start_their_processes_before_the_first_job(monkeypatch):
    """Each worker's process starts with its thread (its interpreter and imports overlap what
    comes before the first job); ``prestart`` does it once a process, for the next block."""
    started = threading.Semaphore(0)

    def start(self):
        started.release()
        raise OSError("no process here")  # the job then starts it again, and fails with it

    monkeypatch.setattr(precompile.Workers, "_start", start)
    workers = precompile.Workers(3)
    try:
        for _ in range(3):
            assert started.acquire(timeout=30)
    finally:
        workers.close()
    monkeypatch.setattr(precompile, "_EARLY", [None, False])
    monkeypatch.setattr(precompile, "enabled", lambda device: True)
    precompile.prestart(CUDA)
    early = precompile._EARLY[0]
    try:
        assert isinstance(early, precompile.Workers)
        precompile.prestart(CUDA)
        assert precompile._EARLY[0] is early  # once a process
        assert precompile._take_early() is early and precompile._take_early() is None
        precompile.prestart(CUDA)
        assert precompile._EARLY[0] is None
    finally:
        early.close()


def test_a_pass_leaves_its_processes_to_the_next_for_a_while(monkeypatch):
    """The processes of a pass wait for the next one (``_park``), one pool at a time, until
    ``PARKED_S`` runs out (``_expire``) or the environment they were started in changes (they
    would write another Triton cache than the launching process reads)."""

    def start(self):
        raise OSError("no process here")

    monkeypatch.setattr(precompile.Workers, "_start", start)
    monkeypatch.setattr(precompile, "_EARLY", [None, True])

    def closed(w):
        return not any(t.is_alive() for t in w._threads)

    first, second, third = (precompile.Workers(1) for _ in range(3))
    precompile._park(first)
    assert precompile._take_early() is first and precompile._take_early() is None
    precompile._park(first)
    precompile._park(second)  # one pool waits at a time: the other is closed
    assert closed(second) and not closed(first)
    precompile._expire(first)
    assert closed(first) and precompile._take_early() is None
    precompile._park(third)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/another/cache")
    assert precompile._take_early() is None and closed(third)


def test_a_units_winners_compile_while_the_next_units_keys_are_timed(monkeypatch, compiled_kind):
    """``compile_then_tune`` with one callable a unit: a unit that left keys to time runs
    again in the second block (on another thread, its launches only compiling) as soon as its
    last key is timed, while the next unit's keys are timed; each key is timed once, a unit
    that left none does not run again, and an error in the timing is raised, leaving the
    units not yet run to the step."""

    def start(self):
        raise OSError("no process here")  # no worker processes: nothing here compiles

    monkeypatch.setattr(precompile.Workers, "_start", start)
    monkeypatch.setattr(precompile, "_EARLY", [None, True])
    ran = {name: threading.Event() for name in "abc"}
    events, timed = [], []

    def unit(name, keys):
        def run():
            pending = getattr(_launch.AHEAD, "pending", None)
            events.append((name, pending is not None, _launch.launches_only_compile()))
            if pending is not None:  # the first block: the keys left to time
                pending.extend((name, (k,), (), None) for k in range(keys))
                return
            assert {(name, k) for k in range(keys)} <= set(timed)  # decided, every key
            ran[name].set()

        return run

    class Tuner:
        def choose(self, kernel, key, configs, *rest):
            assert not _launch.launches_only_compile()  # on the card, outside the blocks
            if kernel == "c":  # the first unit's winners compile meanwhile
                assert ran["a"].wait(timeout=30), "the second block waited for every key"
            if kernel == "c" and key == (1,) and fail:
                raise RuntimeError("a timing failed")
            timed.append((kernel, key[0]))

    monkeypatch.setattr(_launch, "TUNER", Tuner())
    runs = [unit("a", 2), unit("b", 0), unit("c", 2)]
    for fail in (False, True):
        events.clear()
        timed.clear()
        for event in ran.values():
            event.clear()
        if fail:
            with pytest.raises(RuntimeError, match="a timing failed"):
                precompile.compile_then_tune(CUDA, runs, "test")
        else:
            assert precompile.compile_then_tune(CUDA, runs, "test")
        precompile._take_early().close()
        first = [(n, True, True) for n in "abc"]
        second = [("a", False, True)] + ([] if fail else [("c", False, True)])
        assert events[:3] == first and sorted(events[3:]) == second
        assert timed == [("a", 0), ("a", 1), ("c", 0)] + ([] if fail else [("c", 1)])


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH: Python 3.11 on")
def test_a_worker_imports_the_package_of_its_parent_whatever_its_working_directory(tmp_path):
    """A folder named muon_offload in the working directory (a source checkout installed
    elsewhere) does not shadow, in a worker, the package its parent runs."""
    shadow = tmp_path / "muon_offload"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the shadowing folder')\n")
    job = ("muon_offload.kernels.sumsq", "no_such_kernel", {}, {}, {}, None, {})
    done = subprocess.run(
        precompile.WORKER,
        input=pickle.dumps(job),
        capture_output=True,
        cwd=tmp_path,
        env=precompile._worker_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reply = pickle.loads(done.stdout)
    assert reply.startswith("AttributeError") and "no_such_kernel" in reply, reply
