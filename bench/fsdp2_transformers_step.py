"""The FSDP2 iteration: a transformers Qwen3-MoE of ~1.3 B parameters under FSDP2 with
bf16 mixed precision and gradient clipping, whole training iterations with each optimizer: ours
resident, ours offloaded with fp32 and with 8-bit state, dion's resident ``Muon``.

    torchrun --nproc-per-node 2 bench/fsdp2_transformers_step.py --out out/fsdp2_tf.json
    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 2 bench/fsdp2_transformers_step.py --tiny \
        --out tiny.json  # CPUs, gloo

``Qwen3MoeForCausalLM`` at 1,324,649,472 parameters: 16 layers, hidden 1024, 48 experts (top
8) of FFN 512 in every layer, 16 query and 8 key-value heads of 64, a 32,000-token vocabulary,
untied head; fp32, random from ``--seed`` on the device (no download), alike on every rank.
Each mode builds it afresh and ``fully_shard``s each decoder layer and the root over a 1-D mesh
of every rank with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: fp32
master weights and gradients sharded on dim 0, bf16 compute. The expert stacks (gate_up [48,
1024, 1024], down [48, 1024, 512]) are thereby sharded on their expert dim, whole experts per
rank, which Muon steps without communication (bench/multi_gpu.py puts them on an expert mesh
of the same ranks). Groups from ``muon_param_groups``, then ``Muon(groups,
distributed_mesh=mesh)``; dion gets the same groups and mesh.

An iteration: a barrier, forward on this rank's random tokens with ``labels``, backward,
``clip_grad_norm_(1.0)``, lr times a cosine factor, ``step()``, ``zero_grad()``, a device sync.
Figures: per iteration the slowest rank's seconds, median over ``--iters`` after ``--warmup``;
the step's seconds likewise (CUDA events); peak GPU memory from the built model on (the warm-up
creates the state), the highest rank's; host state bytes per rank; the loss averaged over
ranks. The JSON is rewritten after each mode; a mode that fails (out of memory, a refusal)
records its error and the next runs (a failure on one rank only can leave the others waiting in
a collective until the process group's timeout).
"""

from __future__ import annotations

import os

# dion eager (see bench/transformers_step.py); read when torch is imported.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from fsdp2_transformers_report import combine, compare, table  # noqa: E402
from transformers_step import Meter, cosine, import_dion, parameter_counts  # noqa: E402

from muon_offload import Muon, muon_param_groups  # noqa: E402
from muon_offload.tools import options  # noqa: E402
from muon_offload.tools.bench import machine  # noqa: E402
from muon_offload.tools.bench import modes as hyper  # noqa: E402
from muon_offload.tools.bench.dion_runner import dion_commit  # noqa: E402

# bench/ is on sys.path when this file runs as a script.
from multi_gpu_modes import has_list_all_to_all  # noqa: E402
from multi_gpu_ranks import barrier, everyone, init, keep_multicast_off  # noqa: E402

# In the order they run: the reference first.
MODES = {
    "ours_resident": dict(offload=False),
    "ours_offload_fp32": dict(offload=True),
    "ours_offload_int8": dict(offload=True, state_dtype=torch.int8),
    "dion_resident": None,
}
MODEL = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3072,  # dense MLP: unused, every layer is sparse
    moe_intermediate_size=512,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    num_experts=48,
    num_experts_per_tok=8,
)
TINY_MODEL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
)
DEFAULTS = dict(batch=8, seq=1024, warmup=3, iters=5)  # batch: per rank
TINY_DEFAULTS = dict(batch=2, seq=16, warmup=1, iters=1)
TINY_CHUNK_BYTES = 2 << 10  # the tiny model's state in several chunks


def config(args):
    import transformers

    sizes = dict(TINY_MODEL if args.tiny else MODEL)
    sizes["num_hidden_layers"] = args.layers or sizes["num_hidden_layers"]  # parse: >= 1
    return transformers.Qwen3MoeConfig(
        **sizes, max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False
    )


def build_model(cfg, seed: int, device: torch.device, mesh):
    """fp32 weights, the same on every rank, then FSDP2 per decoder layer and the root."""
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, attn_implementation="sdpa"
        )
    model.to(device).train()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def optimizer(name: str, model, mesh, args, dion):
    """bench/transformers_step.py's groups and hyper-parameters, with the mesh."""
    groups = muon_param_groups(
        model,
        lr=hyper.MUON_LR,
        adamw_lr=hyper.ADAMW_LR,
        adamw_betas=hyper.ADAMW_BETAS,
        adamw_epsilon=hyper.ADAMW_EPS,
        adamw_weight_decay=hyper.ADAMW_WEIGHT_DECAY,
    )
    if name == "dion_resident":
        return dion.Muon(groups, distributed_mesh=mesh, lr=hyper.MUON_LR)
    kw = dict(MODES[name])
    if kw["offload"] and args.chunk_bytes is not None:
        kw["chunk_bytes"] = args.chunk_bytes
    return Muon(groups, distributed_mesh=mesh, lr=hyper.MUON_LR, **kw)


def train(name: str, args, cfg, tokens, device, mesh, dion) -> dict:
    """This rank's figures of one mode."""
    meter = Meter(device)
    start_bytes = meter.allocated()  # what earlier modes left allocated: 0 where all was freed
    model = build_model(cfg, args.seed, device, mesh)
    opt = optimizer(name, model, mesh, args, dion)
    base_lrs = [g["lr"] for g in opt.param_groups]
    total = args.warmup + args.iters
    iter_s, steps, losses = [], [], []
    barrier(meter)
    meter.reset_peak()
    for i in range(total):
        for group, lr in zip(opt.param_groups, base_lrs, strict=True):
            group["lr"] = lr * cosine(i, total)
        barrier(meter)
        start = time.perf_counter()
        loss = model(input_ids=tokens[i], labels=tokens[i]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step_seconds = meter.timed_step(opt)
        opt.zero_grad(set_to_none=True)
        meter.sync()
        seconds = time.perf_counter() - start
        losses.append(loss.item())
        if i >= args.warmup:
            iter_s.append(seconds)
            steps.append(step_seconds())
    row = {
        "iter_s": iter_s,
        "step_s": steps,
        "losses": losses,
        "start_bytes": start_bytes,
        "peak_bytes": meter.peak(),
        "held_bytes": meter.allocated(),
        "host_state_bytes": getattr(opt, "host_state_bytes", None),  # dion: None
        "experts_implementation": model.config._experts_implementation,
    }
    del model, opt, loss
    return row


def environment(device: torch.device, args, cfg, counts: dict, dion) -> dict:
    import transformers

    card, cuda = machine.card(device), device.type == "cuda"
    root = os.path.dirname(os.path.dirname(os.path.abspath(dion.__file__))) if dion else None
    return {
        "card": card,
        "cards": everyone(card),
        "driver": machine.driver_version() if cuda else None,
        **machine.versions(),
        "cuda": torch.version.cuda,
        "nccl": str(torch.cuda.nccl.version()) if cuda else None,
        "transformers": transformers.__version__,
        "dion": (dion_commit(root) or root) if dion else None,
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "date": machine.now(),
        "args": {k: str(v) if isinstance(v, torch.device) else v for k, v in vars(args).items()},
        "model": {
            "class": "Qwen3MoeForCausalLM",
            **{k: getattr(cfg, k) for k in MODEL},
            "tie_word_embeddings": False,
            "attn_implementation": "sdpa",
            **counts,
        },
        "fsdp2": "fully_shard per decoder layer and the root, one 1-D mesh of every rank; "
        "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), fp32 master weights",
        "state_dtype": "fp32 (the master weights' dtype) but ours_offload_int8: int8",
        "tokens": f"random, batch {args.batch} x seq {args.seq} per rank, seeded by seed + rank",
    }


def parse(argv):
    cuda = torch.cuda.is_available()
    ap = options.parser("fsdp2_transformers_step.py", __doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write (rank 0)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, 1 + 1 iterations")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    for key in ("batch", "seq", "warmup", "iters"):  # batch: per rank
        tiny = TINY_DEFAULTS[key]
        ap.add_argument(f"--{key}", type=int, help=f"default {DEFAULTS[key]}; tiny {tiny}")
    ap.add_argument("--layers", type=int, default=None, help="default 16; tiny 2")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    chunk = f"offloaded modes' chunk size (default: the optimizer's; tiny {TINY_CHUNK_BYTES})"
    ap.add_argument("--chunk-bytes", type=int, help=chunk)
    ap.add_argument("--dion-path", default=None, help="folder holding the dion package")
    ap.add_argument("--seed", type=int, default=0, help="model init; token ids: seed + rank")
    args = ap.parse_args(argv)
    for key, value in (TINY_DEFAULTS if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < (0 if key == "warmup" else 1):
            ap.error(f"--{key} must be >= {0 if key == 'warmup' else 1}")
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be >= 1")
    args.chunk_bytes = args.chunk_bytes or (TINY_CHUNK_BYTES if args.tiny else None)
    if args.device == "cuda" and not cuda:
        ap.error("--device cuda, but no CUDA GPU is available")
    if args.device == "cpu" and cuda:  # offload=True refuses CPU parameters where a GPU is
        ap.error("--device cpu is the check on CPUs: hide the GPUs (CUDA_VISIBLE_DEVICES=)")
    return args


def run_mode(name, args, cfg, tokens, device, mesh, dion) -> dict:
    """One mode on every rank; its figures over ranks, or every rank's error."""
    try:
        mine = train(name, args, cfg, tokens, device, mesh, dion)
    except Exception as e:  # out of memory, a refusal: recorded, the next mode runs
        mine = {"error": f"{type(e).__name__}: {e}"[:4000]}
        traceback.print_exc()
    Meter(device).free()
    return combine(everyone(mine))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.tiny and args.device == "cpu":
        torch.set_num_threads(1)  # tiny matrices; the processes share the cores
    keep_multicast_off()
    device, meshes = init(args.device)
    mesh, rank = meshes["dense"], dist.get_rank()
    args.device = device
    logging.getLogger("muon_offload").setLevel(logging.ERROR)  # notices, once per rank and mode
    cfg = config(args)
    counts = parameter_counts(cfg)
    dion, dion_missing = import_dion(args.dion_path)
    if dion is not None and not has_list_all_to_all(mesh, device):
        dion, dion_missing = None, f"{dist.get_backend()} lacks the list-form all_to_all"
    gen = torch.Generator().manual_seed(args.seed + rank)
    shape = (args.warmup + args.iters, args.batch, args.seq)
    tokens = torch.randint(cfg.vocab_size, shape, generator=gen).to(device)
    result = {"info": environment(device, args, cfg, counts, dion), "modes": {}}
    if rank == 0:
        muon, adamw = counts["muon_parameters"], counts["adamw_parameters"]
        print(
            f"Qwen3MoeForCausalLM, {counts['parameters']:,} parameters ({muon:,} Muon, "
            f"{adamw:,} AdamW); {result['info']['tokens']}, {args.warmup} warm-up + "
            f"{args.iters} timed iterations, {dist.get_world_size()} x {device.type}",
            flush=True,
        )
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for name in args.modes:
        start = time.perf_counter()
        if name == "dion_resident" and dion is None:
            row = {"skipped": dion_missing}
        else:
            row = run_mode(name, args, cfg, tokens, device, mesh, dion)
        row["mode_wall_s"] = time.perf_counter() - start
        result["modes"][name] = row
        result["target"] = compare(result["modes"])
        if rank == 0:
            summary = row.get("skipped") or row.get("error") or f"{row['median_iter_s']:.4f} s"
            print(f"{name}: {summary} ({row['mode_wall_s']:.1f} s)", flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    if rank == 0:
        print(table(result))
        print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as e:  # --help, a usage error
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported; torchrun then ends the other ranks
        traceback.print_exc()
        code = 1
    # gloo with DTensor can abort in interpreter teardown (tests/dist_workers.py::_finish).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
