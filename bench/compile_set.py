"""The Triton variants that a first step compiles on an H200 (sm_90), read on the CPU, and what
each costs to compile.

    PYTHONPATH=bench:. python bench/compile_set.py --workload moe --layers 16
    PYTHONPATH=bench:. python bench/compile_set.py --workload odd --compile --json out/odd.json

One ``step()`` of the workload runs on meta tensors with ``backend="triton"`` as the parallel
compile pass runs it on a GPU (``precompile.compile_then_tune``: every launch only compiles):
the package's tuner decides each key as on the card, from the shipped table (``--table``) where
it has the key's class or a nearest one; a key the card would time compiles its candidates'
timing launches in the first block and, decided between the blocks (here: for its first
candidate, one winner whichever wins), its winner's own launch in the second. Each launch's
variant is read off its arguments as Triton's ``JITFunction.run`` reads it for sm_90
(``specialize_impl``: pointer alignment, an int's divisibility by 16 and ``== 1``, dtypes,
constexprs, options); distinct variants are what the pass compiles. For each kernel the tool
names the fields its variants differ in. ``--compile``: each variant compiled with
``triton.compile`` into a fresh cache, one at a time: its seconds and PTX hash.
Workloads: ``moe`` and ``dense`` (bench/training_loop.py's models,
``--mode`` one of its OURS), ``odd`` (ten odd matrix shapes, fp32), ``demo``
(``muon-offload demo``'s two optimizers). ``--autotune-off``: as MUON_OFFLOAD_AUTOTUNE=0.
"""

from __future__ import annotations

import os
import sys

if os.environ.pop("TRITON_INTERPRET", None) == "1":
    # Re-exec without it: jit functions are made interpreted-kind at import when it is set.
    os.execv(sys.executable, [sys.executable, *sys.argv])

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import pkgutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import muon_offload.kernels  # noqa: E402
import torch  # noqa: E402

for _module in pkgutil.iter_modules(muon_offload.kernels.__path__):  # as compiled-kind jit
    importlib.import_module(f"muon_offload.kernels.{_module.name}")

from muon_offload.kernels import _launch, tuning  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
TABLE = "tune-NVIDIA_H200-triton3.6.0.json"


class Variants:
    """Stands in for ``JITFunction.run``: one entry per variant Triton would compile."""

    def __init__(self) -> None:
        self.backend = make_backend(TARGET)
        self.found: dict[tuple, dict] = {}
        self._binders: dict[int, object] = {}

    def __call__(self, fn: JITFunction, *args, grid, warmup, **kwargs):
        binder = self._binders.get(id(fn))
        if binder is None:
            binder = create_function_from_signature(fn.signature, fn.params, self.backend)
            self._binders[id(fn)] = binder
        bound, specialization, options = binder(*args, **kwargs)
        key = (fn.__name__, str(specialization), str(sorted(options.items())))
        if key not in self.found:
            opts, signature, constexprs, attrs = fn._pack_args(
                self.backend, dict(options), bound, specialization, options
            )
            self.found[key] = dict(
                fn=fn,
                signature=signature,
                constexprs=constexprs,
                attrs=attrs,
                options=opts,
                fields=_fields(fn, specialization, options),
            )


def _fields(fn: JITFunction, specialization, options) -> dict[str, str]:
    """What tells variants of a kernel apart, by name: each argument's (type, specialization)
    and each option."""
    out = {
        p.name: repr(s[1]) if s[0] == "constexpr" else f"{s[0]}:{s[1]}"
        for p, s in zip(fn.params, specialization, strict=False)
    }
    out.update({f"opt.{k}": repr(v) for k, v in options.items()})
    return out


def _tuner(table: str):
    """The package's tuner as on the card, its cache empty and ``table`` the shipped one."""
    tuner = _launch.Tuner()
    cache = Path(tempfile.mkdtemp(prefix="compile_set_tune_")) / table
    cuda = torch.device("cuda")

    def choose(kernel, key, configs, interpreter_config, device, bench, force=False):
        return tuner.choose(kernel, key, configs, interpreter_config, cuda, bench, force)

    return tuner, choose, cache


def record(step, autotune: bool, table: str) -> tuple[Variants, list, int]:
    """The variants ``step()`` compiles in the pass (``precompile.compile_then_tune``), its
    launches only compiling: the first block's, then (keys timed between them, here decided
    for their first candidate: one winner a key whichever wins) the second's. Also the keys
    timed, and how many of the variants the first block compiled."""
    variants = Variants()
    tuner, choose, cache = _tuner(table)
    saved = _launch.Tuner.cache_path, _launch.interpreted, os.environ.get("MUON_OFFLOAD_AUTOTUNE")
    os.environ["MUON_OFFLOAD_AUTOTUNE"] = "1" if autotune else "0"
    with tuning.recording_keys():
        _launch.TUNER.choose = choose
        _launch.Tuner.cache_path = staticmethod(lambda device: cache)
        _launch.interpreted = lambda: False  # the tuner's reading only: as on the card
        JITFunction.run = lambda self, *a, grid, warmup, **kw: variants(
            self, *a, grid=grid, warmup=warmup, **kw
        )
        _launch.AHEAD.on, _launch.AHEAD.pending = True, []
        try:
            step()
            pending, _launch.AHEAD.pending = _launch.AHEAD.pending, None
            first = len(variants.found)
            for kernel, key, configs, *_ in pending:
                name = "|".join(str(k) for k in (kernel, *key))
                tuner._memory[name] = {"config": dataclasses.asdict(configs[0])}
            if pending:
                step()
        finally:
            _launch.AHEAD.on, _launch.AHEAD.pending = False, None
            _launch.Tuner.cache_path = staticmethod(saved[0])
            _launch.interpreted = saved[1]
            if saved[2] is None:
                os.environ.pop("MUON_OFFLOAD_AUTOTUNE", None)
            else:
                os.environ["MUON_OFFLOAD_AUTOTUNE"] = saved[2]
    timed = {f"{k}|{'|'.join(map(str, key))} ({len(c)} candidates)" for k, key, c, *_ in pending}
    return variants, sorted(timed), first


def _workload(args):
    """A function that builds the optimizer of the workload and runs its first step."""
    import training_loop as loop
    from transformers_step import MUON_LR, bench_groups, build_model
    from tuning_keys import as_streamed

    from muon_offload import Muon

    meta = torch.device("meta")

    def grads(params):
        for p in params:
            p.grad = torch.zeros_like(p)

    if args.workload in ("moe", "dense"):
        cfg = loop.config(
            args.workload, argparse.Namespace(tiny=False, layers=args.layers, seq=1024)
        )
        model = build_model(cfg, 0, meta, torch.float32)
        grads(model.parameters())
        settings = as_streamed(loop.OURS[args.mode])
        opts = [Muon(bench_groups(model), lr=MUON_LR, backend="triton", **settings)]
    elif args.workload == "odd":
        shapes = [
            (1000, 333),
            (17, 4097),
            (5, 3),
            (4, 64, 96),
            (333, 1000),
            (129, 257),
            (640, 2000),
            (3000, 700),
            (96, 4500),
            (50, 50),
        ]
        ps = [torch.nn.Parameter(torch.zeros(s, device=meta)) for s in shapes]
        vec = [torch.nn.Parameter(torch.zeros(n, device=meta)) for n in (1000, 4097, 333)]
        grads(ps + vec)
        groups = [{"params": ps}, {"params": vec, "algorithm": "adamw", "lr": 1e-3}]
        opts = [Muon(groups, lr=0.01, backend="triton")]
    else:  # demo
        from muon_offload.tools import demo

        models = [demo.TinyGPT(64, 64, 2, 4, 32).to(meta) for _ in range(2)]
        for m in models:
            grads(m.parameters())
        opts = [
            Muon(demo.param_groups(models[0]), lr=0.02, backend="triton"),
            Muon(
                demo.param_groups(models[1]),
                lr=0.02,
                backend="triton",
                **as_streamed(dict(offload=True, chunk_bytes=256 << 10)),
            ),
        ]

    def step():
        for opt in opts:
            opt.step()

    return step


def _varying(entries: list[dict]) -> dict[str, list[str]]:
    """The fields whose values differ among a kernel's variants, with the values."""
    names = sorted({k for e in entries for k in e["fields"]})
    out = {}
    for name in names:
        values = sorted({e["fields"].get(name, "-") for e in entries})
        if len(values) > 1:
            out[name] = values
    return out


def compile_each(entries: list[dict]) -> None:
    """Compile each variant into a fresh cache, one at a time: seconds and the PTX's hash."""
    import triton
    from triton.compiler import ASTSource

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_set_")
    for e in entries:
        src = ASTSource(e["fn"], e["signature"], e["constexprs"], e["attrs"])
        start = time.perf_counter()
        try:
            kernel = triton.compile(src, target=TARGET, options=e["options"].__dict__)
            e["ptx"] = hashlib.sha1(kernel.asm["ptx"].encode()).hexdigest()[:10]
        except Exception as err:  # noqa: BLE001 (reported beside the others)
            e["ptx"] = f"FAILED {type(err).__name__}"
        e["seconds"] = time.perf_counter() - start
        print(f"  {e['fn'].__name__:34} {e['seconds']:6.2f} s  ptx {e['ptx']}", flush=True)


def _ptx(e: dict, attrs: dict) -> str:
    import triton
    from triton.compiler import ASTSource

    src = ASTSource(e["fn"], e["signature"], e["constexprs"], attrs)
    kernel = triton.compile(src, target=TARGET, options=e["options"].__dict__)
    return "\n".join(line for line in kernel.asm["ptx"].splitlines() if not line.startswith("//"))


def divisibility_check(entries: list[dict]) -> dict[str, list[int]]:
    """For each variant and each int argument it has specialized as a multiple of 16, the
    variant compiled again without it: {kernel.argument: [same PTX, different PTX]}. Where it
    is never the same, the specialization changes code wherever it varies, and
    ``do_not_specialize`` would cut variants only by changing steady-state kernels (a GPU
    measurement); where always, it would cut them for free."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_set_div_")
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in entries:
        ptx = None
        for i, param in enumerate(e["fn"].params):
            if e["signature"].get(param.name) not in ("i32", "i64") or (i,) not in e["attrs"]:
                continue
            ptx = ptx or _ptx(e, e["attrs"])
            fewer = {k: v for k, v in e["attrs"].items() if k != (i,)}
            counts[f"{e['fn'].__name__}.{param.name}"][_ptx(e, fewer) != ptx] += 1
    for name, (same, differ) in sorted(counts.items()):
        print(f"  {name}: {same} variants the same PTX without %16, {differ} not", flush=True)
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("compile_set.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("moe", "dense", "odd", "demo"), default="moe")
    ap.add_argument("--mode", default="ours_resident", help="moe / dense: a training_loop mode")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--table", default=TABLE)
    ap.add_argument("--autotune-off", action="store_true")
    ap.add_argument("--compile", action="store_true", help="compile each variant for sm_90")
    ap.add_argument("--divisibility", action="store_true", help="PTX without each int's %%16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    step = _workload(args)
    variants, timed, first = record(step, not args.autotune_off, args.table)
    by_kernel: dict[str, list[dict]] = defaultdict(list)
    for e in variants.found.values():
        by_kernel[e["fn"].__name__].append(e)
    print(
        f"{args.workload}: {len(variants.found)} variants of {len(by_kernel)} kernels; "
        f"{len(timed)} keys timed on the card; {first} variants in the first block, "
        f"{len(variants.found) - first} in the second"
    )
    for name in timed:
        print(f"  timed: {name}")
    for kernel, entries in sorted(by_kernel.items()):
        print(f"{kernel}: {len(entries)}")
        for field, values in _varying(entries).items():
            print(f"    {field}: {', '.join(values)}")
    if args.compile:
        entries = [e for es in by_kernel.values() for e in es]
        compile_each(entries)
        total = sum(e["seconds"] for e in entries)
        top = max(entries, key=lambda e: e["seconds"])
        print(
            f"compiled {len(entries)} in {total:.1f} s (slowest {top['seconds']:.1f} s, "
            f"{top['fn'].__name__})"
        )
    if args.divisibility:
        divisibility_check([e for es in by_kernel.values() for e in es])
    if args.json:
        rows = [
            {
                "kernel": e["fn"].__name__,
                "fields": e["fields"],
                "seconds": e.get("seconds"),
                "ptx": e.get("ptx"),
            }
            for es in by_kernel.values()
            for e in es
        ]
        with open(args.json, "w") as f:
            json.dump({"timed": timed, "variants": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
