"""Compile every Triton kernel variant the optimizers launch, for a Hopper GPU, on a machine
without one: ``python tests/kernel_compile_check.py`` (run by tests/test_kernels_compile.py).

The interpreter that runs the kernels in CPU tests accepts code that the compiler rejects (a
jit function passed as a constexpr argument ran there and failed to compile on the H200 with
triton 3.6), so each kernel is also built down to a cubin for sm_90 here. How: the kernel
modules are imported as real (compiled-kind) jit functions; then, with ``TRITON_INTERPRET=1``
set only afterwards, the optimizers take their kernel paths on CPU tensors; every launch is
recorded instead of run (its signature is read off the arguments), once for each tuning config
the launcher could pick; and each distinct variant is compiled with ``triton.compile``.
Nothing runs, so the recorded steps compute nothing: only the launches matter.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pkgutil
import re
import sys
import time
import traceback

if os.environ.pop("TRITON_INTERPRET", None) == "1":
    # Re-exec without it: jit functions are made interpreted-kind at import when it is set.
    os.execv(sys.executable, [sys.executable, *sys.argv])

import muon_offload.kernels  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from muon_offload.kernels import _launch, _tma  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

import muon_offload  # noqa: E402

# Every kernel module now, while TRITON_INTERPRET is unset (the engine imports some lazily).
for _module in pkgutil.iter_modules(muon_offload.kernels.__path__):
    importlib.import_module(f"muon_offload.kernels.{_module.name}")

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")

_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}


def _type_of(value) -> str:
    if isinstance(value, TensorDescriptor):  # a host TMA descriptor: "tensordesc<bf16[1, 128, 64]>"
        return mangle_type(value)
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type a kernel argument {value!r}")


def _freeze(value):
    return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)


class Recorder:
    """Stands in for ``JITFunction.run``: keeps one entry per distinct compiled variant."""

    def __init__(self):
        self.variants: dict[tuple, tuple] = {}

    def __call__(self, fn: JITFunction, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        signature, constexprs = {}, {}
        for i, param in enumerate(fn.params):
            value = args[i] if i < len(args) else kwargs[param.name]
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            else:
                signature[param.name] = _type_of(value)
        key = (
            fn.__name__,
            tuple(signature.items()),
            tuple((k, _freeze(v)) for k, v in constexprs.items()),
            tuple(sorted(options.items())),
        )
        self.variants.setdefault(key, (fn, signature, constexprs, options))


def _model_params(dtype: torch.dtype, cautious_wd: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.nn.Parameter(torch.randn(*shape, generator=gen).to(dtype))

    # Wide, tall, square-even and a 3-D stack; vectors for the element-wise rules. Sizes above
    # the 8-bit state's minimum so that those kernels run too.
    matrices = [rand(72, 96), rand(96, 72), rand(128, 128), rand(3, 48, 100)]
    return [
        {"params": matrices, "cautious_wd": cautious_wd},
        {"params": [rand(5000), rand(4099)], "algorithm": "adamw", "cautious_wd": cautious_wd},
        {"params": [rand(4500)], "algorithm": "lion", "cautious_wd": cautious_wd},
    ]


def _config_lists() -> list[tuple]:
    """Every module-level tuple of tuning configs in the kernel modules."""
    lists = []
    for _module in pkgutil.iter_modules(muon_offload.kernels.__path__):
        module = importlib.import_module(f"muon_offload.kernels.{_module.name}")
        for value in vars(module).values():
            if isinstance(value, tuple) and value and isinstance(value[0], _launch.Config):
                lists.append(value)
    return lists


def drive(config_index: int) -> None:
    """One step of each optimizer configuration, the tuner forced to its config_index'th
    config (clipped to the list)."""

    def choose(kernel, key, configs, interpreter_config, device, bench, force=False):
        return configs[min(config_index, len(configs) - 1)]

    _launch.TUNER.choose = choose
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for state_dtype in (None, torch.int8):
            for ortho in ("polar_express", "newton_schulz5", "gram_newton_schulz"):
                groups = _model_params(dtype)
                opt = muon_offload.Muon(
                    groups, lr=0.01, orthogonalizer=ortho, backend="triton", state_dtype=state_dtype
                )
                for group in groups:
                    for p in group["params"]:
                        p.grad = torch.randn_like(p)
                opt.step()
            # The kernels' cautious_wd variants (a constexpr flag of the element-wise kernels
            # and Muon's apply kernel, which it takes in place of the fused last product).
            groups = _model_params(dtype, cautious_wd=True)
            opt = muon_offload.Muon(groups, lr=0.01, backend="triton", state_dtype=state_dtype)
            for group in groups:
                for p in group["params"]:
                    p.grad = torch.randn_like(p)
            opt.step()
    from muon_offload.kernels.orthogonalize import (
        ORTHOGONALIZERS,
        orthogonalize_apply_,
        orthogonalize_on,
    )

    # The products on Triton (the engine picks them on CUDA for 16-bit batches; the CPU
    # takes torch's unless asked), each shape class: wide, tall, square, tile-even; and
    # with Muon's apply in the last product, on fp32 and bf16 parameters.
    scalars = torch.ones(2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for method in ORTHOGONALIZERS:
            for shape in ((2, 72, 96), (2, 96, 72), (1, 64, 64), (1, 128, 256)):
                x = torch.randn(*shape).to(dtype)
                orthogonalize_on(x, None, method=method, products="triton_all")
                for p_dtype in (torch.float32, torch.bfloat16):
                    params = [torch.zeros(shape[1:], dtype=p_dtype) for _ in range(shape[0])]
                    kw = dict(method=method, products="triton_all")
                    orthogonalize_apply_(x, None, params, scalars, **kw)


def drive_tma() -> None:
    """The TMA configs of the 2-D products with every code path their launchers can take
    (the recorded steps, on small matrices, reach only some): layouts (rows contiguous,
    ``.mT`` views, a padded row stride), Y, the diagonal, symmetrize, w, alpha X, tiles that
    divide the matrix or not, the normalization's scale folded in (Polar Express's first
    iteration, bf16), Muon's apply in place of out (the last product's: the parameters in the
    product's layout or transposed, fp32 and bf16); bf16, and fp16 (Gram Newton-Schulz's)
    with the first config."""
    from muon_offload.kernels import gram, poly_apply
    from muon_offload.kernels.normalize import norm_scale_arg
    from muon_offload.kernels.poly_apply_tma import ParamApply, apply_kernel_args

    scale = norm_scale_arg(torch.ones(2), 1.02, 1e-8, 2, torch.device("cpu"))

    def layouts(b, r, c, dtype):
        """[b, r, c] rows contiguous, a .mT view, and rows padded to a multiple of 16."""
        yield torch.zeros(b, r, c, dtype=dtype)
        yield torch.zeros(b, c, r, dtype=dtype).mT
        yield torch.zeros(b, r, c + 16, dtype=dtype)[:, :, :c]

    gram_configs = [c for c in gram.GRAM_CONFIGS if c.tma]
    poly_configs = [c for c in poly_apply.POLY_APPLY_CONFIGS if c.tma]
    for dtype in (torch.bfloat16, torch.float16):
        if dtype == torch.float16:
            gram_configs, poly_configs = gram_configs[:1], poly_configs[:1]
        for config in gram_configs:
            for x in layouts(2, 200, 264, dtype):
                assert _tma.tma_layout(x) is not None
                out = torch.zeros(2, 200, 200, dtype=dtype)
                # Polar Express: X X^T; Gram Newton-Schulz: R = X X^T symmetrized, S T.
                gram._launch(x, x, None, out, 1.0, 0.0, 0.0, False, config)
                if dtype == torch.bfloat16:
                    gram._launch(x, x, None, out, 1.0, 0.0, 0.0, False, config, scale)
                gram._launch(x, x, None, out, 1.0, 0.0, 0.0, True, config)
                w = torch.zeros(2, 200, 264, dtype=dtype)
                gram._launch(x, w, None, out, 1.0, 0.0, 0.0, True, config)
                gram._launch(w, x, None, out, 1.0, 0.0, 0.0, True, config)
            a = torch.zeros(2, 200, 200, dtype=dtype)
            out = torch.zeros(2, 200, 200, dtype=dtype)
            # b A + c A A; Gram Newton-Schulz's with a I, symmetrized.
            gram._launch(a, a, a, out, 0.5, -1.7, 0.0, False, config)
            gram._launch(a, a, a, out, 0.5, -1.7, 2.3, True, config)
        for config in poly_configs:
            for m, n in ((200, 264), (256, 512)):  # masked and even epilogues
                poly = torch.zeros(2, m, m, dtype=dtype)
                for x in layouts(2, m, n, dtype):
                    out = torch.zeros(2, m, n, dtype=dtype)
                    for alpha in (3.9, 0.0):
                        poly_apply._launch(poly, x, out, alpha, config)
                    if dtype == torch.bfloat16:
                        poly_apply._launch(poly, x, out, 3.9, config, scale)
                    for p_dtype, strides in ((torch.float32, (n, 1)), (torch.bfloat16, (1, m))):
                        table = torch.zeros(2, dtype=torch.int64)
                        to = ParamApply(table, p_dtype, strides, torch.ones(2), True)
                        alpha = 0.0 if dtype == torch.float16 else 2.3  # Gram NS: Q X
                        apply = apply_kernel_args(to, torch.bfloat16, x)
                        poly_apply._launch(poly, x, x, alpha, config, None, apply)
                poly_apply._launch(poly.mT, x, out, 3.9, config)  # column-major poly


TMA_KERNELS = ("_sym_gram_tma_kernel", "_poly_apply_tma_kernel")
_VARIANTS: list[tuple] = []
# Constexprs and options that only size the tiles (the tuning configs): a kernel's code paths
# are its other constexprs (dtypes, flags), and each tile size is compiled once, not once per
# combination with them.
# FLATTEN and WARP_SPECIALIZE (the TMA kernels' loop) are paths: each is compiled with every
# flag combination, the loop-flattening pass being where triton 3.6 failed on one.
TILE_CONSTEXPRS = ("BLOCK", "BLOCK_M", "BLOCK_N", "BLOCK_K", "CHUNK", "LOG2_BLOCK")


def _tile_cost(variant) -> int:
    """How much a variant's tiles cost to compile: the product of its tile sizes and stages."""
    _, _, constexprs, options = variant
    cost = options.get("num_stages", 1) * options.get("num_warps", 1)
    for name in TILE_CONSTEXPRS:
        if isinstance(constexprs.get(name), int):
            cost *= constexprs[name]
    return cost


def _path_type(value: str) -> str:
    """A signature type without what the tile sets: a TMA descriptor's block shape."""
    return re.sub(r"\[[0-9, ]*\]", "[]", value) if value.startswith("tensordesc") else value


def _covering(variants) -> list[tuple]:
    """A subset that compiles every code path once and every tile config once per kernel,
    each path with the cheapest tile that reaches it (ptxas time grows with the tile)."""
    chosen, paths, tiles = [], set(), set()
    for variant in sorted(variants, key=_tile_cost):
        fn, signature, constexprs, options = variant
        tile = tuple((k, v) for k, v in constexprs.items() if k in TILE_CONSTEXPRS)
        path = tuple((k, _freeze(v)) for k, v in constexprs.items() if k not in TILE_CONSTEXPRS)
        types = tuple((k, _path_type(v)) for k, v in signature.items())
        by_path = (fn.__name__, types, path)
        by_tile = (fn.__name__, tile, tuple(sorted(options.items())))
        if by_path not in paths or by_tile not in tiles:
            chosen.append(variant)
            paths.add(by_path)
            tiles.add(by_tile)
    return chosen


def _compile(index: int) -> str:
    """'' when variant ``index`` compiles, else its name, constexprs and the error's tail."""
    fn, signature, constexprs, options = _VARIANTS[index]
    try:
        triton.compile(ASTSource(fn, signature, constexprs), target=TARGET, options=options)
    except Exception as err:  # report every failing variant, not only the first
        tail = "".join(traceback.format_exception_only(err)).strip()[-1500:]
        return f"{fn.__name__} {constexprs} {options}\n{tail}"
    return ""


def main() -> int:
    recorder = Recorder()
    JITFunction.run = lambda self, *a, grid, warmup, **kw: recorder(
        self, *a, grid=grid, warmup=warmup, **kw
    )
    os.environ["TRITON_INTERPRET"] = "1"  # after import: kernel paths on CPU tensors
    started = time.perf_counter()
    for index in range(max(len(c) for c in _config_lists())):
        drive(index)
    drive_tma()
    variants = _covering(recorder.variants.values())
    tma_count = sum(fn.__name__ in TMA_KERNELS for fn, *_ in variants)
    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None
    if only:
        variants = [v for v in variants if v[0].__name__ in only]
    names = sorted({fn.__name__ for fn, *_ in variants})
    print(f"triton {triton.__version__}: {len(variants)} variants of {len(names)} kernels")
    print(f"TMA kernels: {tma_count} variants")
    # Every launch names its multiply-add contraction: triton 3.10 flips the default, and a
    # kernel's bits must not change with the Triton version (kernels/_launch.py, FP_FUSION).
    implicit = {fn.__name__ for fn, _, _, opts in variants if "enable_fp_fusion" not in opts}
    implicit = sorted(implicit)
    if implicit:
        print("FAILED: launched without enable_fp_fusion: " + ", ".join(implicit))
    global _VARIANTS
    _VARIANTS = variants
    workers = max(1, min(4, os.cpu_count() or 1))
    print(f"compiling on {workers} processes (minutes on a cold Triton cache)", flush=True)
    errors, step = [], max(1, len(variants) // 10)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for error in pool.imap_unordered(_compile, range(len(variants))):
            errors.append(error)
            if len(errors) % step == 0 or len(errors) == len(variants):
                elapsed = time.perf_counter() - started
                print(f"  {len(errors)}/{len(variants)} compiled, {elapsed:.0f} s", flush=True)
    failed = [e for e in errors if e]
    for error in failed[:5]:
        print(error)
    if failed:
        print(f"FAILED: {len(failed)} variants (first {min(5, len(failed))} above):")
        for error in failed:
            print("  " + error.splitlines()[0])
    seconds = time.perf_counter() - started
    print(f"compiled {len(variants) - len(failed)}/{len(variants)} in {seconds:.0f} s")
    print("kernels:", ", ".join(names))
    return 1 if failed or implicit else 0


if __name__ == "__main__":
    sys.exit(main())
