"""Count the compiled variants a first step needs on an H200, on a machine without one:
``python tests/kernel_variant_count.py moe LAYERS [HIDDEN EXPERTS]`` (a Qwen3-MoE's tensors:
16 layers, hidden 1024 and 48 experts is the 1.32 B model) or ``... odd`` (odd shapes);
several runs separated by ``--``.

A variant is what Triton compiles once: its key is Triton's own (the binder's specialization
of every argument for sm_90: dtypes, pointer alignment, integers equal to 1 or divisible by
16, constexprs; and the launch options). As in kernel_compile_check.py, the kernels are
imported compiled-kind, then the step runs with ``TRITON_INTERPRET=1`` on CPU tensors, every
launch recorded instead of run; the GPU's decisions are taken (TMA, the products on Triton
for 16-bit batches, the shipped H200 table's configs; a key the table does not decide takes
the first config, as ``MUON_OFFLOAD_AUTOTUNE=0`` does). Prints one JSON line: the count per
kernel, the launches, and the tuning keys the table did not decide.
"""

from __future__ import annotations

import collections
import functools
import importlib
import json
import os
import pkgutil
import sys

if os.environ.pop("TRITON_INTERPRET", None) == "1":
    os.execv(sys.executable, [sys.executable, *sys.argv])  # jit kinds are fixed at import

import muon_offload.kernels  # noqa: E402
import torch  # noqa: E402
from muon_offload.kernels import _launch, gram, orthogonalize, poly_apply  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import muon_offload  # noqa: E402

for _module in pkgutil.iter_modules(muon_offload.kernels.__path__):
    importlib.import_module(f"muon_offload.kernels.{_module.name}")

BACKEND = make_backend(GPUTarget("cuda", 90, 32))
TABLE = "tune-NVIDIA_H200-triton3.6.0.json"


class Recorder:
    """Stands in for ``JITFunction.run``: one entry per distinct Triton cache key."""

    def __init__(self):
        self.binders, self.variants, self.launches = {}, set(), collections.Counter()

    def __call__(self, fn, *args, grid, warmup, **kwargs):
        binder = self.binders.get(fn)
        if binder is None:
            binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
            self.binders[fn] = binder
        _, specialization, options = binder(*args, **kwargs)
        self.variants.add((fn.__name__, repr(specialization), repr(sorted(options.items()))))
        self.launches[fn.__name__] += 1


def as_on_an_h200(untabled: collections.Counter) -> None:
    """The decisions the step takes on an H200 with the shipped table, on CPU tensors."""
    gram.tma_enabled = poly_apply.tma_enabled = lambda device: True
    inner = orthogonalize._orthogonalize

    def on_gpu(update, sumsq, method, eps, products, apply_to):
        if products == "auto":
            x = update.mT if update.size(-2) > update.size(-1) else update
            products = orthogonalize.products_for(x)
        return inner(update, sumsq, method, eps, products, apply_to)

    orthogonalize._orthogonalize = on_gpu
    tuner = _launch.TUNER

    def choose(kernel, key, configs, interpreter_config, device, bench, force=False):
        name = f"{kernel}|" + "|".join(str(k) for k in key)
        pick = functools.partial(_launch._cached_config, configs=configs)
        found = tuner._shipped.choice(TABLE, name, pick)
        if found is None:
            untabled[kernel] += 1
            return configs[0]
        return found[1]

    tuner.choose = choose


def _param(*shape):
    # Left unwritten: no kernel runs (each launch is recorded instead) and what a step launches
    # follows from shapes, dtypes and alignment alone, so the values are never read; writing
    # gigabytes of random numbers was most of the run.
    return torch.nn.Parameter(torch.empty(*shape))


def moe_groups(layers: int, hidden: int = 1024, experts: int = 48) -> list[dict]:
    """Qwen3-MoE's tensors (heads of 64, 16 query and 8 key-value heads at hidden 1024,
    expert FFN hidden / 2); the embedding, head and norms on AdamW."""
    ffn, kv = hidden // 2, hidden // 2
    mats, rest = [], [_param(32000, hidden), _param(32000, hidden), _param(hidden)]
    for _ in range(layers):
        mats += [_param(hidden, hidden), _param(kv, hidden), _param(kv, hidden)]
        mats += [_param(hidden, hidden), _param(experts, hidden)]
        mats += [_param(experts, 2 * ffn, hidden), _param(experts, hidden, ffn)]
        rest += [_param(64), _param(64), _param(hidden), _param(hidden)]
    return [{"params": mats}, {"params": rest, "algorithm": "adamw"}]


def odd_groups() -> list[dict]:
    shapes = [(1000, 333), (17, 4097), (5, 3), (4, 64, 96), (333, 1000), (100, 7), (2, 129, 65)]
    rest = [_param(n) for n in (1000, 333, 17, 4097)]
    return [{"params": [_param(*s) for s in shapes]}, {"params": rest, "algorithm": "adamw"}]


def main(argv: list[str]) -> dict:
    recorder, untabled = Recorder(), collections.Counter()
    JITFunction.run = lambda self, *a, grid, warmup, **kw: recorder(
        self, *a, grid=grid, warmup=warmup, **kw
    )
    as_on_an_h200(untabled)
    os.environ["TRITON_INTERPRET"] = "1"  # after import: kernel paths on CPU tensors
    groups = odd_groups() if argv[0] == "odd" else moe_groups(*map(int, argv[1:]))
    opt = muon_offload.Muon(groups, lr=0.01, backend="triton")
    for group in groups:
        for p in group["params"]:
            p.grad = torch.empty_like(p)  # unwritten, as the parameters are
    opt.step()
    per_kernel = collections.Counter(name for name, *_ in recorder.variants)
    return dict(
        variants=len(recorder.variants),
        per_kernel=dict(sorted(per_kernel.items())),
        launches=sum(recorder.launches.values()),
        untabled_keys=dict(untabled),
    )


if __name__ == "__main__":
    # Several runs in one process: ``moe 1 -- moe 2``, one JSON line each.
    runs = " ".join(sys.argv[1:]).split(" -- ")
    for run in runs:
        print(json.dumps(main(run.split())), flush=True)
