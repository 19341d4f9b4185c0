"""``muon-offload tune``: tune the kernels for the shapes of a workload on this GPU.

Times every candidate config of each kernel on scratch tensors of the workload's shapes,
stores the winners in the tuning cache (``MUON_OFFLOAD_CACHE_DIR``, else
``~/.cache/muon_offload``), and prints the chosen config and achieved bandwidth per kernel
(bytes read + written over the median time of the winner). ``--state-dtype int8`` tunes the
8-bit state's kernels for the tensors the optimizer keeps in 8 bits and the fp32 ones for the
small tensors that stay fp32, as the optimizer lays them out.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import TYPE_CHECKING

from . import options
from .workloads import MAX_LAYERS, WORKLOADS, workload

if TYPE_CHECKING:  # imported by the run: --help and usage errors answer without torch
    import torch

DTYPES = ("bf16", "fp32")  # by torch's names, ``_dtype``
STATE_DTYPES = (*DTYPES, "int8")
DESCRIPTION = "Tune the kernels for the shapes of a workload on this GPU."


def parser():
    ap = options.parser("muon-offload tune", DESCRIPTION)
    ap.add_argument(
        "--workload",
        default="qwen3-30b-a3b-ep8-rank",
        choices=sorted(WORKLOADS),
        help="whose shapes to tune for (docs/benchmarks.md, Workloads)",
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="keep the first N layers (default: all)"
    )
    ap.add_argument("--batch", type=int, default=8, help="matrices per Muon launch")
    ap.add_argument("--param-dtype", default="fp32", choices=sorted(DTYPES), help="weights")
    ap.add_argument("--grad-dtype", default="fp32", choices=sorted(DTYPES), help="gradients")
    ap.add_argument(
        "--state-dtype",
        default="fp32",
        choices=sorted(STATE_DTYPES),
        help="state (int8: the 8-bit state's kernels, fp32 for tensors too small for 8 bits)",
    )
    ap.add_argument("--cached", action="store_true", help="report cached choices, time nothing new")
    ap.add_argument(
        "--json", default=None, help="also write the results to this file (default: none)"
    )
    return ap


def _parse(argv: list[str] | None):
    ap = parser()
    args = ap.parse_args(argv)
    most = MAX_LAYERS[args.workload]
    if args.layers is not None and not 1 <= args.layers <= (most or args.layers):
        ap.error(f"--layers must be >= 1 and at most {most}, got {args.layers}")
    if args.batch < 1:
        ap.error("--batch must be >= 1")
    return args


def _dtype(name: str) -> torch.dtype:
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8}[name]


def tune_kernels(args, device: torch.device) -> list[dict]:
    """Runs each kernel the workload's step launches once, on scratch tensors of its shapes,
    timing every candidate config (unless ``args.cached``); one row a kernel and shape."""
    import torch

    from muon_offload.engine.state_format import MIN_QUANTIZED_NUMEL
    from muon_offload.kernels import tuning
    from muon_offload.kernels.elementwise import adamw_
    from muon_offload.kernels.muon import muon_apply_, muon_prep
    from muon_offload.kernels.quant_maps import QBLOCK, quantize
    from muon_offload.kernels.quantized_elementwise import adamw8_
    from muon_offload.kernels.quantized_muon import muon_prep8

    p_dt, g_dt = _dtype(args.param_dtype), _dtype(args.grad_dtype)
    eight_bit = args.state_dtype == "int8"
    # With 8-bit state, tensors under MIN_QUANTIZED_NUMEL elements keep fp32 state.
    s_dt = torch.float32 if eight_bit else _dtype(args.state_dtype)
    sz = {d: torch.empty((), dtype=d).element_size() for d in (p_dt, g_dt, s_dt)}
    specs = workload(args.workload, args.layers)
    rows = []

    def in_8_bits(numel: int) -> bool:
        return eight_bit and numel >= MIN_QUANTIZED_NUMEL

    def blocks(numel: int) -> int:  # 8-bit state: one fp32 scale a block
        return -(-numel // QBLOCK)

    def record(kernel: str, shape: str, nbytes: int) -> None:
        label, ms = tuning.last_choice(kernel) or ("?", float("nan"))
        rows.append(
            {
                "kernel": kernel,
                "shape": shape,
                "config": label,
                "ms": ms,
                "GB/s": nbytes / ms / 1e6 if ms == ms else float("nan"),
            }
        )

    def rand(shape, dtype, positive=False):
        x = torch.randn(shape, device=device)
        return (x.abs_().add_(1e-3) if positive else x).to(dtype)

    def codes(shape, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize(rand(shape, torch.float32, positive=kind == "adam_v"), kind)

    with tuning.retuning(not args.cached):
        hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
        adamw = [s for s in specs if s.algorithm == "adamw"]
        dense = [s for s in adamw if not in_8_bits(s.numel)]
        if dense:
            p = [rand(s.shape, p_dt) for s in dense]
            g = [rand(s.shape, g_dt) for s in dense]
            m = [rand(s.shape, s_dt) for s in dense]
            v = [rand(s.shape, s_dt, positive=True) for s in dense]
            adamw_(p, g, m, v, **hyper)
            n = sum(s.numel for s in dense)
            record(
                "adamw",
                f"{len(dense)} tensors, {n} elements",
                n * (2 * sz[p_dt] + sz[g_dt] + 4 * sz[s_dt]),
            )
            del p, g, m, v
        quantized = [s for s in adamw if in_8_bits(s.numel)]
        if quantized:
            p = [rand(s.shape, p_dt) for s in quantized]
            g = [rand(s.shape, g_dt) for s in quantized]
            (mc, ms), (vc, vs) = (
                zip(*(codes(s.shape, kind) for s in quantized), strict=True)
                for kind in ("adam_m", "adam_v")
            )
            adamw8_(p, g, mc, ms, vc, vs, **hyper)
            n = sum(s.numel for s in quantized)
            # Codes (1 B) and scales (4 B a block) of both moments, read and written.
            state_bytes = 4 * n + 16 * sum(blocks(s.numel) for s in quantized)
            record(
                "adamw8",
                f"{len(quantized)} tensors, {n} elements",
                n * (2 * sz[p_dt] + sz[g_dt]) + state_bytes,
            )
            del p, g, mc, ms, vc, vs

        for shape, count in Counter(s.shape for s in specs if s.algorithm == "muon").items():
            batch = min(count, args.batch)
            numel = shape[0] * shape[1]
            grads = [rand(shape, g_dt) for _ in range(batch)]
            label = f"{batch} x {shape[0]}x{shape[1]}"
            if in_8_bits(numel):
                mc, ms = zip(*(codes(shape, "momentum") for _ in range(batch)), strict=True)
                out, _ = muon_prep8(mc, ms, grads, mu=0.95, nesterov=True)
                state_bytes = 2 * numel + 8 * blocks(numel)
                record("muon_prep8", label, batch * (numel * (sz[g_dt] + 2) + state_bytes))
                del mc, ms
            else:
                mom = [rand(shape, s_dt) for _ in range(batch)]
                out, _ = muon_prep(mom, grads, mu=0.95, nesterov=True)
                record("muon_prep", label, batch * numel * (2 * sz[s_dt] + sz[g_dt] + 2))
                del mom
            params = [rand(shape, p_dt) for _ in range(batch)]
            tall = shape[0] > shape[1]
            update = out.mT.contiguous().mT if tall else out  # orthogonalize's layout
            muon_apply_(params, update, lr=0.02, weight_decay=0.1, adjusted_lr=0.02)
            record(
                "muon_apply",
                label + (" (U transposed)" if tall else ""),
                batch * numel * (2 * sz[p_dt] + 2),
            )
            del grads, out, params, update
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "muon-offload tune: needs a CUDA GPU (tuning times kernels on the device)",
            file=sys.stderr,
        )
        return 2
    from muon_offload.kernels import tuning

    device = torch.device("cuda")
    rows = tune_kernels(args, device)
    print(f"{torch.cuda.get_device_name(device)}; cache {tuning.cache_path(device)}")
    print(f"{'kernel':<11} {'shape':<34} {'config':<34} {'ms':>8} {'GB/s':>8}")
    for r in rows:
        print(
            f"{r['kernel']:<11} {r['shape']:<34} {r['config']:<34} {r['ms']:>8.3f} "
            f"{r['GB/s']:>8.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
