"""The training loop users write, timed with each optimizer: fp32 weights, bf16 autocast over
the forward pass, backward, ``clip_grad_norm_(1.0)``, ``step()``, torch's default
``zero_grad()`` (``set_to_none=True``: backward allocates new gradients every iteration).

    python bench/training_loop.py --models moe --json out/training_loop_moe.json
    python bench/training_loop.py --models dense --json out/training_loop_dense.json
    python bench/training_loop.py --tiny --layers 1 --device cpu  # CPU: seconds

Models (random init from ``--seed``, no download; ``AutoModelForCausalLM.from_config``, fp32,
sdpa attention): "dense", bench/transformers_step.py's Qwen3 (24 layers, hidden 2048, MLP 6144,
1.34 B parameters); "moe", a Qwen3-MoE (16 layers, hidden 1024, 48 experts of FFN 512, top 4,
16 query and 4 key-value heads of 64, 32,000-token vocabulary, untied head). ``--tiny``: both
at a few thousand parameters, for CPUs. Batch ``--batch`` x ``--seq`` random token ids, the
same sequence of batches in every mode.

Modes (rows): ``no_step`` (forward, backward, clip, ``model.zero_grad()``: no optimizer), ours
resident, ours offloaded with fp32 and with int8 state (``muon_offload.Muon`` over
``muon_param_groups(model, adamw_lr=...)``: Muon for the hidden matrices and expert stacks,
AdamW for embeddings, head and norms), ours resident and int8 again as ``*_eager``
(``cuda_graph=False``: every step issued eagerly, their host ms the figure), dion's resident
``Muon`` over the same groups (where ``import dion`` works, or ``--dion-path``; eager,
torch.compile off, as in docs/benchmarks.md), torch's AdamW over every parameter
(``fused=True`` on CUDA). The learning rates follow a cosine over each mode's iterations, as
in bench/transformers_step.py.

Every mode keeps its own model and optimizer copy, built from the same seed one after the other,
each running its ``--warmup`` iterations as it is built (the state is created, the graphs of
ours captured). Then ``--rounds`` interleaved rounds: each runs every mode for ``--iters``
iterations, in an order rotated by round, so that a slow spell of the card or host hits every
mode. A mode that fails (out of memory, say) records its error, its copy is freed and the
others go on. The JSON (``--json``) is rewritten after each round.

Columns (training_loop_report.py): the median iteration seconds over the timed iterations (the
device synchronized before the forward and after ``zero_grad()``: nothing inside the
iteration waits); the step share, that median minus ``no_step``'s; the step's GPU milliseconds
(CUDA events recorded on the current stream just before and after ``step()``; the host's
clock on the CPU) and its host milliseconds (``perf_counter`` around the ``step()`` call, no
synchronization: how long the host is held, a figure close to the GPU one meaning the step is
bound by launches; in the ``*_eager`` modes the device is synchronized just before
``step()``, so that backward's launches still queued do not hold the host at a full launch
queue: their host ms is the time to issue the step, set against their graphed twin's GPU
ms); the first ``step()`` of the mode in seconds (first use: kernels compiled, tuned, state
created; kernels compiled by a mode built earlier are not compiled again), apart
from the medians; our CUDA graph captures, replays and eager steps (``graph_stats()``); the peak
memory allocated and reserved (``torch.cuda.max_memory_*``, reset before each of the mode's
blocks of iterations, so they include the other modes' copies; run ``--modes X`` alone for a
mode's own) and the mode's own peak (what its copy holds between iterations plus the most its
iterations added over what was allocated when they began).

``--back-to-back``: each round also runs ``--iters`` iterations of every mode with no
synchronization between them (the device synchronized before the first and after the last),
as a loop that reads no figure each iteration runs: what a step leaves running (its last
stores, the host's queue of launches) overlaps the next iteration. Columns "b2b s" (median over
the rounds of such a block's seconds an iteration) and "b2b share" (that minus ``no_step``'s).
On CUDA each synchronized iteration also records the device milliseconds of its forward, its
backward and the clip (events on the current stream from the iteration's start): a mode whose
hooks or side streams slow backward shows it there against ``no_step``; and what is left of
the iteration after the clip ("after clip": the step, ``zero_grad()`` and the copies the step
leaves running, up to the sync), a mode's own measure of its step's cost that the forward's
and backward's spread between iterations does not move, as it moves the shares. Back-to-back
iterations record the same phases (the report's "back to back"): a forward that waits for
what the last step left running (a small device-to-host copy it syncs on, queued on the copy
engine behind the step's last stores) shows there against its synchronized figure.
"""

from __future__ import annotations

import os

# dion eager (see bench/transformers_step.py); read when torch is imported.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from training_loop_copy import Copy, block  # noqa: E402
from training_loop_report import (  # noqa: E402
    eager_lines,
    environment,
    phase_lines,
    summary,
    table,
)
from transformers_step import MODEL as DENSE  # noqa: E402
from transformers_step import TINY_MODEL as TINY_DENSE  # noqa: E402
from transformers_step import (  # noqa: E402
    Meter,
    bench_groups,
    build_model,
    import_dion,
    parameter_counts,
)

from muon_offload import Muon  # noqa: E402
from muon_offload.tools import options  # noqa: E402
from muon_offload.tools.bench.modes import (  # noqa: E402
    MUON_LR,
    TORCH_ADAMW,
)
from muon_offload.tools.bench.timing import rotated  # noqa: E402

# In the order the copies are built (first use: kernels compiled by an earlier mode are warm).
MODES = (
    "no_step",
    "ours_resident",
    "ours_resident_eager",
    "ours_offload_fp32",
    "ours_offload_int8",
    "ours_offload_int8_eager",
    "ours_offload_int8_512mib",
    "ours_offload_int8_512mib_eager",
    "ours_offload_int8_128mib",
    "ours_offload_fp32_ring",
    "ours_offload_fp32_3gib",
    "ours_offload_fp32_third",
    "ours_offload_int8_ring",
    "dion_resident",
    "torch_adamw",
)
# Run only when named in --modes: other chunk sizes and prefetch_bytes against the defaults
# (graphed 8-bit Muon: 512 MiB chunks; eager: 1 GiB; prefetch_bytes: three fifths of the
# state, a third in 8-bit, at most 3 GiB): the ring, 3 GiB, a third of the state whatever the
# model.
OPTIONAL = (
    "ours_offload_int8_512mib",
    "ours_offload_int8_512mib_eager",
    "ours_offload_int8_128mib",
    "ours_offload_fp32_ring",
    "ours_offload_fp32_3gib",
    "ours_offload_fp32_third",
    "ours_offload_int8_ring",
)
OURS = {
    "ours_resident": dict(offload=False),
    "ours_offload_fp32": dict(offload=True),
    "ours_offload_int8": dict(offload=True, state_dtype=torch.int8),
    # 512 MiB at fp32 width: 128 MiB of 8-bit codes a chunk, units as large as resident ones
    # (the graphed default; its eager twin against the eager default's 1 GiB)
    "ours_offload_int8_512mib": dict(offload=True, state_dtype=torch.int8, chunk_bytes=512 << 20),
    # the fp32 states' 128 MiB: 32 MiB of codes a chunk (the 8-bit default before 512 MiB)
    "ours_offload_int8_128mib": dict(offload=True, state_dtype=torch.int8, chunk_bytes=128 << 20),
    # prefetch_bytes=0: staging of three chunks alone (the ring), as before the default loaded
    # state ahead; 3 GiB; a third of the state (the former fp32 default)
    "ours_offload_fp32_ring": dict(offload=True, prefetch_bytes=0),
    "ours_offload_fp32_3gib": dict(offload=True, prefetch_bytes=3 << 30),
    # a third of the state the step streams, whatever the model (set after the first warm-up
    # iteration, which makes the state: ``AHEAD_SHARE``)
    "ours_offload_fp32_third": dict(offload=True),
    "ours_offload_int8_ring": dict(offload=True, state_dtype=torch.int8, prefetch_bytes=0),
}
# Modes whose prefetch_bytes is this share of their streamed state (``host_state_bytes``),
# assigned after the first warm-up iteration; the warm-up iterations after it capture anew.
AHEAD_SHARE = {"ours_offload_fp32_third": 1 / 3}
# Twins of graphed modes with ``cuda_graph=False``: every step eager, as a first step, a
# closure or a changed set of gradients runs; their host ms is what the host takes to issue it.
EAGER = {
    f"{m}_eager": m for m in ("ours_resident", "ours_offload_int8", "ours_offload_int8_512mib")
}
MOE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=48,
    num_experts_per_tok=4,
)
TINY_MOE = dict(
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
MODELS = {"dense": (DENSE, TINY_DENSE), "moe": (MOE, TINY_MOE)}
DEFAULTS = dict(batch=8, seq=1024, warmup=3, rounds=5, iters=3)
TINY_DEFAULTS = dict(batch=2, seq=16, warmup=1, rounds=1, iters=2)


def config(kind: str, args):
    import transformers

    sizes = dict(MODELS[kind][1 if args.tiny else 0])
    sizes["num_hidden_layers"] = args.layers or sizes["num_hidden_layers"]  # parse: >= 1
    cls = transformers.Qwen3MoeConfig if kind == "moe" else transformers.Qwen3Config
    return cls(
        **sizes,
        max_position_embeddings=max(1024, args.seq),
        tie_word_embeddings=False,
        use_cache=False,
    )


def make_optimizer(name: str, model, device: torch.device, dion):
    """None for ``no_step``; the same groups for ours and dion's (its param-group convention)."""
    if name == "no_step":
        return None
    if name == "torch_adamw":
        return torch.optim.AdamW(
            model.parameters(), **TORCH_ADAMW, fused=True if device.type == "cuda" else None
        )
    groups = bench_groups(model)
    if name == "dion_resident":
        return dion.Muon(groups, lr=MUON_LR)
    if name in EAGER:
        return Muon(groups, lr=MUON_LR, **OURS[EAGER[name]], cuda_graph=False)
    return Muon(groups, lr=MUON_LR, **OURS[name])


def build(name: str, cfg, args, tokens, meter: Meter, dion) -> Copy:
    meter.sync()
    before = meter.allocated()
    model = build_model(cfg, args.seed, args.device, torch.float32)
    opt = make_optimizer(name, model, args.device, dion)
    copy = Copy(model, opt, tokens.shape[0], sync_before_step=name in EAGER)
    for i in range(args.warmup):
        copy.iteration(tokens[copy.done], meter, timed=False)
        if i == 0 and name in AHEAD_SHARE:
            opt.prefetch_bytes = int(opt.host_state_bytes * AHEAD_SHARE[name])
    meter.sync()
    if meter.cuda:
        copy.held = meter.allocated() - before
    return copy


def error(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:4000]}


def run_model(kind: str, args, dion, dion_missing: str, result: dict, write) -> None:
    cfg = config(kind, args)
    counts = parameter_counts(cfg)
    print(
        f"{kind}: {type(cfg).__name__}, {counts['parameters']:,} parameters "
        f"({counts['muon_parameters']:,} Muon, {counts['adamw_parameters']:,} AdamW), fp32 "
        f"weights, bf16 autocast; batch {args.batch} x seq {args.seq}; {args.warmup} warm-up, "
        f"then {args.rounds} rounds x {args.iters} iterations on {args.device}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(args.seed)
    total = args.warmup + args.rounds * args.iters * (2 if args.back_to_back else 1)
    tokens = torch.randint(cfg.vocab_size, (total, args.batch, args.seq), generator=gen)
    tokens = tokens.to(args.device)
    meter = Meter(args.device)
    rows: dict[str, dict] = {}
    sizes = {k: getattr(cfg, k) for k in (*MOE, "max_position_embeddings") if hasattr(cfg, k)}
    out = result["models"][kind] = {"model": {"config": sizes, **counts}, "modes": rows}
    copies: dict[str, Copy] = {}
    for name in args.modes:
        if name == "dion_resident" and dion is None:
            rows[name] = {"skipped": dion_missing}
            continue
        start, failure = time.perf_counter(), None
        try:
            copies[name] = build(name, cfg, args, tokens, meter, dion)
        except Exception as e:  # out of memory, above all: record it, build the next
            failure = error(e)
        if failure:  # freed out of the except block, whose traceback holds the copy
            rows[name] = failure
            meter.free()
        done = failure["error"] if failure else "built and warmed"
        print(f"{kind} {name}: {done} ({time.perf_counter() - start:.1f} s)", flush=True)
    if copies:
        any_model = next(iter(copies.values())).model
        out["model"]["class"] = type(any_model).__name__
        out["model"]["experts_implementation"] = getattr(
            any_model.config, "_experts_implementation", None
        )
    for r in range(args.rounds):
        for name in rotated(list(copies), r):
            failure = None
            try:
                block(copies[name], tokens, args.iters, meter, args.back_to_back)
            except Exception as e:
                failure = error(e)
            if failure:
                rows[name] = failure
                del copies[name]
                meter.free()
                print(f"{kind} {name}: {failure['error']}", flush=True)
        rows.update(summary(copies))
        out["modes"] = rows = {n: rows[n] for n in args.modes if n in rows}  # in build order
        write()
        print(f"{kind}: round {r + 1} of {args.rounds} done", flush=True)
    copies.clear()
    meter.free()


def parse(argv):
    ap = options.parser("training_loop.py", __doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    usual = [m for m in MODES if m not in OPTIONAL]
    ap.add_argument(
        "--modes", nargs="+", choices=MODES, default=usual, help="default: not the *mib ones"
    )
    ap.add_argument("--tiny", action="store_true", help="tiny models for CPUs")
    ap.add_argument(
        "--device",
        type=options.torch_device,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda where there is one)",
    )
    for key, low in (("batch", 1), ("seq", 1), ("warmup", 1), ("rounds", 1), ("iters", 1)):
        ap.add_argument(
            f"--{key}",
            type=int,
            default=None,
            help=f"default {DEFAULTS[key]}, {TINY_DEFAULTS[key]} with --tiny (>= {low})",
        )
    ap.add_argument(
        "--back-to-back",
        action="store_true",
        help="each round also runs --iters iterations per mode with no sync between them",
    )
    ap.add_argument("--layers", type=int, default=None, help="default: 24 dense, 16 MoE; 2 tiny")
    ap.add_argument("--dion-path", default=None, help="folder holding the dion package")
    ap.add_argument("--seed", type=int, default=0, help="model init and token ids")
    args = ap.parse_args(argv)
    for key, value in (TINY_DEFAULTS if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1")
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be >= 1")
    if args.device is None:
        args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options.check_device(ap, args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device.type == "cuda":
        if args.device.index is None:  # torch 2.11's set_device refuses a bare "cuda"
            args.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(args.device)
    dion, dion_missing = import_dion(args.dion_path)
    result = {
        "info": environment(
            args, dion, sys.argv if argv is None else ["bench/training_loop.py", *argv]
        ),
        "models": {},
    }

    def write() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    for kind in args.models:
        run_model(kind, args, dion, dion_missing, result, write)
        write()
    for kind, model in result["models"].items():
        print(f"\n{kind} ({model['model']['parameters']:,} parameters)")
        print(table(model["modes"]))
        print("\n".join(eager_lines(model["modes"], EAGER) + phase_lines(model["modes"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
