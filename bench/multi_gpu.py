"""The multi-GPU bench: a Qwen3-30B-A3B-like model sharded over every rank, the optimizer
step of ours (offloaded with fp32, bf16 and 8-bit state, resident with fp32 and 8-bit state)
against dion's resident ``Muon`` and the all-at-once offload baseline; step time and peak
memory are the worst rank's.

    torchrun --nproc-per-node 8 bench/multi_gpu.py --out out/multi_gpu --dion-path DIR
    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 2 bench/multi_gpu.py --tiny --device cpu \
        --out out/mg_tiny

The model (bench/moe_model.py): Qwen3-30B-A3B's tensors; dense ones are DTensors sharded on
dim 0 over a 1-D mesh of every rank (FSDP2's layout); the expert stacks are sharded on their
expert dim over a 1-D expert-parallel mesh (EP = world size): each rank holds whole experts,
which Muon orthogonalizes without communication. Muon for matrices and expert stacks (experts in a
param group of their own on the expert mesh), AdamW for norms, embedding and lm_head.
Parameters and gradients are random (never zero), seeded per global tensor.

Stages: (1) pinned host<->device bandwidth with every rank copying at once; the per-rank
transfer floor is a rank's state bytes over its both-directions bandwidth, max over ranks (for
8-bit state, the host bytes each rank's optimizer reports: codes and scales).
(2) Each mode: warm-up steps (state creation, pinning, kernel tuning), then timed steps with
a barrier before each; a step's time is the slowest rank's, the figure the median over
steps; peak GPU memory is the max over ranks. (3) Parity: K offloaded steps with small chunks
on a smaller copy of the model against one process stepping the full tensors (rank 0).
Rank 0 writes ``multi_gpu.json`` into ``--out`` after every stage, so a crash keeps what ran,
and prints a table at the end.
"""

from __future__ import annotations

import os

# dion eager (torch.compile off): its compiled step never finished a first step on the H200
# (docs/benchmarks.md, "Workloads"). Read when dion's functions are decorated, so set before
# torch and dion are imported. Ours uses no torch.compile; this changes nothing of ours.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from multi_gpu_floors import floors, ratios  # noqa: E402

from muon_offload.distributed import local  # noqa: E402
from muon_offload.tools import options  # noqa: E402
from muon_offload.tools.bench import machine  # noqa: E402
from muon_offload.tools.bench.dion_runner import dion_commit, find_dion  # noqa: E402
from muon_offload.tools.bench.progress import Progress  # noqa: E402
from muon_offload.tools.bench.report import (  # noqa: E402  # noqa: E402
    MODE_COLUMNS,
    bandwidth_text,
    mode_header,
    mode_row,
    note_row,
    num,
)
from muon_offload.tools.bench.timing import (  # noqa: E402
    GIB,
    Clock,
    bandwidths,  # noqa: E402
)

# bench/ is on sys.path when this file runs as a script (torchrun bench/multi_gpu.py).
from moe_model import (  # noqa: E402  # noqa: E402
    QWEN3_30B_A3B,
    QWEN3_LAYERS,
    TINY,
    TINY_LAYERS,
    Dims,
    build_params,
    model_specs,
    set_grads,
    state_bytes,
)
from multi_gpu_modes import has_list_all_to_all, load_dion, run_modes  # noqa: E402
from multi_gpu_parity import (  # noqa: E402
    PARITY_CHUNK_BYTES,
    STATE_DTYPES,
    TINY_PARITY_CHUNK_BYTES,
    parity,
    parity_line,
)
from multi_gpu_ranks import barrier, everyone, init, keep_multicast_off  # noqa: E402

MODES = (
    "ours_offload_fp32",
    "ours_offload_bf16",
    "ours_offload_int8",
    "ours_resident",
    "ours_resident_int8",
    "dion_resident",
    "all_at_once",
)
LABELS = {
    "ours_offload_fp32": "ours offload fp32",
    "ours_offload_bf16": "ours offload bf16",
    "ours_offload_int8": "ours offload int8",
    "ours_resident": "ours resident",
    "ours_resident_int8": "ours resident int8",
    "dion_resident": "dion resident (eager)",
    "all_at_once": "all-at-once offload",
}
# The single-GPU table's columns with each mode's absolute peak before the added memory.
COLUMNS = (*MODE_COLUMNS[:3], ("peak GiB", "peak_gib", 10, ".2f"), *MODE_COLUMNS[3:])
NO_GPU = "no CUDA GPU: nothing crosses PCIe, and peak GPU memory is not measured"
TINY_CHUNK_BYTES = 2 << 10  # the tiny model's ~20 KiB of state per rank in several chunks


@dataclass
class Context:
    args: argparse.Namespace
    dims: Dims
    device: torch.device
    meshes: dict
    clock: Clock
    json_path: Path

    def write(self, results: dict) -> None:
        if dist.get_rank() == 0:
            self.json_path.write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------ running


def environment(args, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    card = machine.card(device)
    versions = machine.versions()
    return {
        "card": card,
        "cards": everyone(card),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device": device.type,
        "torch": versions["torch"],
        "triton": versions["triton"],
        "python": versions["python"],
        "cuda": torch.version.cuda,
        "nccl": str(torch.cuda.nccl.version()) if cuda else None,
        "cpu_threads": torch.get_num_threads(),
        "dion_commit": dion_commit(args.dion_root) if args.dion_root else None,
        "date": machine.now(),
        "args": dict(vars(args)),
    }


def model_info(args, dims: Dims, specs, params) -> dict:
    per_rank_state = everyone(state_bytes(params, specs))
    return {
        "name": "qwen3-30b-a3b-like" if not args.tiny else "tiny",
        "dims": asdict(dims),
        "layers": args.layers,
        "ep": dist.get_world_size(),
        "params_global": sum(torch.Size(s.shape).numel() for s in specs),
        "params_per_rank": everyone(sum(local(p).numel() for p in params)),
        "state_bytes_per_rank": per_rank_state,
        "state_gib_max": max(per_rank_state) / GIB,
    }


def run(ctx: Context) -> dict:
    args, clock = ctx.args, ctx.clock
    progress = Progress(enabled=dist.get_rank() == 0)
    results: dict = {"info": environment(args, ctx.device)}
    if clock.cuda:
        progress(f"bandwidth, {dist.get_world_size()} ranks at once")
        # A barrier starts each repetition, so all ranks copy in the same phase.
        before = lambda: barrier(clock)
        bw = everyone(bandwidths(args.bandwidth_bytes, before_each=before, device_copy=False))
        results["bandwidth_gbps"] = {
            "per_rank": bw,
            "min_over_ranks": {k: min(r[k] for r in bw) for k in bw[0]},
        }
        clock.free()
    else:
        results["bandwidth_gbps"] = None
        results["bandwidth_note"] = NO_GPU

    progress(f"model: {args.layers} layers")
    specs = model_specs(ctx.dims, args.layers)
    params = build_params(specs, ctx.meshes, ctx.device, seed=args.seed)
    set_grads(params, specs, args.seed, step=0)
    results["model"] = model_info(args, ctx.dims, specs, params)
    results["floor"] = floors(
        results["model"]["state_bytes_per_rank"],
        results["bandwidth_gbps"]["per_rank"] if results["bandwidth_gbps"] else None,
    )
    if not clock.cuda:
        results["floor_note"] = NO_GPU
    results["modes"] = {}
    ctx.write(results)

    dion, dion_note = load_dion(args)
    if dion is not None and not has_list_all_to_all(ctx.meshes["dense"], ctx.device):
        dion = None
        dion_note = (
            f"dion needs the list-form all_to_all, which {dist.get_backend()} lacks in torch "
            f"{torch.__version__}"
        )
    run_modes(ctx, specs, params, dion, dion_note, results, progress)
    ratios(results)
    del params
    ctx.write(results)

    if args.parity_steps > 0:
        results["parity"] = parity(ctx, progress)
    else:
        results["parity"] = {"skipped": "--parity-steps 0"}
    ctx.write(results)
    return results


def table(r: dict) -> str:
    """The results as ``muon-offload bench`` prints them; every figure the worst rank's."""
    i, m, bw, floor = r["info"], r["model"], r["bandwidth_gbps"], r["floor"]
    a = i["args"]
    lines = [
        f"{i['card']} x {i['world_size']} ({i['backend']}) | torch {i['torch']} | "
        f"triton {i['triton'] or '-'} | {i['date']}",
        f"model {m['name']}, {m['layers']} layers, EP {m['ep']}, FSDP {m['ep']}: "
        f"{m['state_gib_max']:.4g} GiB of fp32 state on the fullest rank; {a['warmup']} warm-up "
        f"+ {a['steps']} timed steps per mode; times and memory: the worst rank's",
    ]
    if bw:
        lines.append(
            f"bandwidth GB/s, all {i['world_size']} ranks copying at once (lowest rank): "
            + bandwidth_text(bw["min_over_ranks"])
        )
        per_rank = ", ".join(f"{x['both_each']:.1f}" for x in bw["per_rank"])
        lines.append(f"  both at once, each rank: {per_rank}")
    else:
        lines.append(f"bandwidth and transfer floor: not measured ({r['bandwidth_note']})")
    f32, b16 = floor["fp32"], floor["bf16"]
    i8 = num(floor["int8"]["floor_s"], ".3f") if "int8" in floor else "-"
    lines.append(
        f"per-rank floor (max over ranks): fp32 {num(f32['floor_s'], '.3f')} s, "
        f"bf16 {num(b16['floor_s'], '.3f')} s, int8 (host bytes: codes + scales) {i8} s"
    )
    lines += ["", mode_header(COLUMNS)]
    for key, label in LABELS.items():
        x = r["modes"].get(key, {})
        if "median_s" in x:
            if key == "all_at_once":
                label = f"{label} ({'dion' if x['around'] == 'dion_resident' else 'ours'})"
            lines.append(mode_row(label, x, COLUMNS))
        elif "skipped" in x:
            lines.append(note_row(label, x["skipped"]))
    t = r.get("target")
    if t and t["offload_fp32_to_floor"] is not None:
        verdict = "met" if t["met"] else "NOT met"
        lines.append(
            f"target: offload fp32 <= {t['offload_fp32_to_floor_at_most']} x floor: "
            f"{t['offload_fp32_to_floor']:.2f} x, {verdict}"
        )
    if r.get("parity"):
        lines.append(parity_line(r["parity"]))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ options


def parse(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    ap = options.parser("multi_gpu.py", __doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--out", default="out/multi_gpu", help="folder for multi_gpu.json")
    ap.add_argument("--tiny", action="store_true", help="small dims and few experts (CPU check)")
    ap.add_argument("--layers", type=int, default=None, help=f"default {QWEN3_LAYERS}; tiny 2")
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu", help="device"
    )
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what to time")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each mode")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per mode")
    ap.add_argument(
        "--chunk-bytes",
        type=int,
        default=None,
        help=f"offloaded modes' chunk size (default: the optimizer's; {TINY_CHUNK_BYTES} tiny)",
    )
    ap.add_argument(
        "--bandwidth-bytes", type=int, default=GIB, help="bytes per copy of the bandwidth test"
    )
    ap.add_argument("--parity-steps", type=int, default=3, help="0 leaves parity out")
    ap.add_argument("--parity-layers", type=int, default=1, help="layers of the parity model")
    ap.add_argument(
        "--parity-chunk-bytes",
        type=int,
        default=None,
        help=f"default {PARITY_CHUNK_BYTES}; {TINY_PARITY_CHUNK_BYTES} tiny",
    )
    ap.add_argument(
        "--parity-state-dtype",
        choices=tuple(STATE_DTYPES),
        default="fp32",
        help="state of both parity runs (int8: 8-bit state of the sharded tensors)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seeds parameters and gradients")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's; tiny: 1)"
    )
    ap.add_argument(
        "--dion-path",
        default=None,
        help="folder holding the dion package (default: an importable dion)",
    )
    ap.add_argument("--no-dion", action="store_true", help="leave dion out")
    args = ap.parse_args(argv)

    if args.device == "cuda" and not cuda:
        ap.error("--device cuda, but no CUDA GPU is available")
    if args.device == "cpu" and cuda:
        # offload=True refuses CPU parameters where a GPU is present.
        ap.error("--device cpu is the check on CPUs: hide the GPUs (CUDA_VISIBLE_DEVICES=)")
    if args.layers is None:
        args.layers = TINY_LAYERS if args.tiny else QWEN3_LAYERS
    for flag in ("layers", "parity_layers", "warmup", "steps", "bandwidth_bytes"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.parity_steps < 0:
        ap.error("--parity-steps must be >= 0")
    if args.chunk_bytes is None and args.tiny:
        args.chunk_bytes = TINY_CHUNK_BYTES
    if args.parity_chunk_bytes is None:
        args.parity_chunk_bytes = TINY_PARITY_CHUNK_BYTES if args.tiny else PARITY_CHUNK_BYTES
    if args.threads is None and args.tiny and args.device == "cpu":
        args.threads = 1  # tiny matrices; several processes share the cores
    args.dion_root, args.dion_note = None, "left out (--no-dion)"
    if not args.no_dion:
        try:
            args.dion_root, args.dion_note = find_dion(args.dion_path)
        except FileNotFoundError as err:
            ap.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_multicast_off()
    device, meshes = init(args.device)
    dims = TINY if args.tiny else QWEN3_30B_A3B
    if dims.experts % dist.get_world_size():
        raise SystemExit(
            f"{dims.experts} experts do not divide over {dist.get_world_size()} ranks (EP = world)"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The optimizer's notices (the CPU path of offload=True) would repeat per rank and mode.
    logging.getLogger("muon_offload").setLevel(logging.ERROR)
    ctx = Context(args, dims, device, meshes, Clock(device), out / "multi_gpu.json")
    results = run(ctx)
    if dist.get_rank() == 0:
        print(table(results))
        print(f"\nwrote {ctx.json_path}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001 - reported, then the process leaves with code 1
        # Leave at once, without the interpreter's teardown of a live process group (which
        # can hang or abort, see below): torchrun then ends the other ranks.
        traceback.print_exc()
        code = 1
    # gloo with DTensor can abort in interpreter teardown once the work is done (see
    # tests/dist_workers.py::_finish): leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
