"""``muon-offload tune``: tune the kernels for the shapes of a workload on this GPU.

Times every candidate config of each kernel on scratch tensors of the workload's shapes,
stores the winners in the tuning cache (``MUON_OFFLOAD_CACHE_DIR``, else
``~/.cache/muon_offload``), and prints the chosen config and achieved bandwidth per kernel
(bytes read + written over the median time of the winner).
"""

from __future__ import annotations

import json
from collections import Counter

import torch

from . import options
from .workloads import MAX_LAYERS, WORKLOADS, workload

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
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
    ap.add_argument("--state-dtype", default="fp32", choices=sorted(DTYPES), help="state")
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


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("muon-offload tune: needs a CUDA GPU (tuning times kernels on the device)")
        return 2
    from muon_offload.kernels import tuning
    from muon_offload.kernels.elementwise import adamw_
    from muon_offload.kernels.muon import muon_apply_, muon_prep

    device = torch.device("cuda")
    p_dt, g_dt, s_dt = (DTYPES[d] for d in (args.param_dtype, args.grad_dtype, args.state_dtype))
    sz = {d: torch.empty((), dtype=d).element_size() for d in (p_dt, g_dt, s_dt)}
    specs = workload(args.workload, args.layers)
    rows = []

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

    with tuning.retuning(not args.cached):
        adamw = [s for s in specs if s.algorithm == "adamw"]
        if adamw:
            p = [rand(s.shape, p_dt) for s in adamw]
            g = [rand(s.shape, g_dt) for s in adamw]
            m = [rand(s.shape, s_dt) for s in adamw]
            v = [rand(s.shape, s_dt, positive=True) for s in adamw]
            adamw_(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
            n = sum(s.numel for s in adamw)
            record(
                "adamw",
                f"{len(adamw)} tensors, {n} elements",
                n * (2 * sz[p_dt] + sz[g_dt] + 4 * sz[s_dt]),
            )
            del p, g, m, v

        for shape, count in Counter(s.shape for s in specs if s.algorithm == "muon").items():
            batch = min(count, args.batch)
            numel = shape[0] * shape[1]
            mom = [rand(shape, s_dt) for _ in range(batch)]
            grads = [rand(shape, g_dt) for _ in range(batch)]
            out, _ = muon_prep(mom, grads, mu=0.95, nesterov=True)
            label = f"{batch} x {shape[0]}x{shape[1]}"
            record("muon_prep", label, batch * numel * (2 * sz[s_dt] + sz[g_dt] + 2))
            params = [rand(shape, p_dt) for _ in range(batch)]
            tall = shape[0] > shape[1]
            update = out.mT.contiguous().mT if tall else out  # orthogonalize's layout
            muon_apply_(params, update, lr=0.02, weight_decay=0.1, adjusted_lr=0.02)
            record(
                "muon_apply",
                label + (" (U transposed)" if tall else ""),
                batch * numel * (2 * sz[p_dt] + 2),
            )
            del mom, grads, out, params, update
        torch.cuda.synchronize()

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
