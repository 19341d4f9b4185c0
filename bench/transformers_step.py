"""A transformers causal LM trained a few iterations in a plain torch loop with each optimizer:
ours offloaded, ours resident, dion's resident ``Muon``, ours offloaded with 8-bit state.

    python bench/transformers_step.py --out out/transformers_step.json  # one GPU
    python bench/transformers_step.py --tiny --out tiny.json  # CPU: ~15 s

The model is Qwen3's layout (``transformers.Qwen3Config``) at 1,339,138,048 parameters (24
layers, hidden 2048, MLP 6144, 16 query and 8 key-value heads of 128, a 32,000-token vocabulary,
untied head), bf16 weights, randomly initialized from ``--seed``: no download. Each mode builds
it afresh from the same seed on the device (the previous model and optimizer freed, the CUDA
cache emptied), groups it with ``muon_param_groups`` (dion gets the same groups: they are its
param-group convention) and runs ``--warmup`` untimed then ``--iters`` timed iterations of:
forward on random token ids (the same ids in every mode) with ``labels``, backward,
``clip_grad_norm_(1.0)``, the groups' lr times a cosine factor, ``step()``,
``zero_grad(set_to_none=True)``.

Recorded per mode: the iteration's seconds (device synchronized at both ends; median, min, max), the
step's seconds (CUDA events around ``opt.step()`` on the compute stream), the peak GPU memory (reset
once the model is built, so it spans the warm-up, which creates the state) and that peak over the
weights and gradients, the peak a step adds over what was allocated when it began, what stays
allocated between iterations beyond the weights (the state of resident modes, our staging ring), the
host bytes of our offloaded state, every loss. State keeps the weights' dtype (bf16, as dion),
except in ``ours_offload_int8``. The modes run in the order of their importance, and the JSON is
rewritten after each, so a run cut short keeps what finished; a mode that fails (out of memory, say)
records its error and the next one runs. dion is optional (``import dion``, or ``--dion-path``) and
runs eagerly (torch.compile off, as in docs/benchmarks.md); without it its mode says why it was
skipped. ``--tiny``: a 2-layer model, one warm-up and one timed iteration, for CPUs
(``offload=True`` then runs its chunked pipeline through host memory).
"""

from __future__ import annotations

import os

# dion eager: its compiled step never finished a first step on the H200 (docs/benchmarks.md,
# "Workloads"). Read when torch is imported (see bench/resident_vs_dion.py).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from muon_offload import Muon, muon_param_groups  # noqa: E402
from muon_offload.tools import options  # noqa: E402
from muon_offload.tools.bench import machine  # noqa: E402
from muon_offload.tools.bench.dion_runner import dion_commit  # noqa: E402
from muon_offload.tools.bench.modes import (  # noqa: E402
    ADAMW_BETAS,
    ADAMW_EPS,
    ADAMW_LR,
    ADAMW_WEIGHT_DECAY,
    MUON_LR,
)
from muon_offload.tools.bench.report import num  # noqa: E402
from muon_offload.tools.bench.timing import GIB  # noqa: E402

# In the order they run: a run cut short still has the first ones.
MODES = {
    "ours_offload": dict(offload=True),
    "ours_resident": dict(offload=False),
    "dion_resident": None,
    "ours_offload_int8": dict(offload=True, state_dtype=torch.int8),
}
MODEL = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)
TINY_MODEL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
DEFAULTS = dict(batch=8, seq=1024, warmup=3, iters=5)
TINY_DEFAULTS = dict(batch=2, seq=16, warmup=1, iters=1)
DION_INSTALL = 'pip install "git+https://github.com/microsoft/dion@0a059a4" (not on PyPI)'


def config(args):
    import transformers

    sizes = dict(TINY_MODEL if args.tiny else MODEL)
    if args.layers is not None:
        sizes["num_hidden_layers"] = args.layers
    return transformers.Qwen3Config(
        **sizes, max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False
    )


def build_model(cfg, seed: int, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    import transformers

    torch.manual_seed(seed)
    with device:  # initialized where it trains: no copy on the host
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, attn_implementation="sdpa"
        )
    return model.to(device=device, dtype=dtype).train()


def import_dion(path: str | None):
    """(the dion module, None) or (None, why its mode is skipped)."""
    if path:
        sys.path.insert(0, os.path.abspath(path))
    try:
        import dion
    except ImportError as e:
        return None, f"dion is not importable ({e}): {DION_INSTALL}, or pass --dion-path DIR"
    return dion, None


def bench_groups(model) -> list[dict]:
    """Muon for the hidden matrices, AdamW for the rest, at the bench's settings: the same
    groups for ours and dion's (its param-group convention)."""
    return muon_param_groups(
        model,
        lr=MUON_LR,
        adamw_lr=ADAMW_LR,
        adamw_betas=ADAMW_BETAS,
        adamw_epsilon=ADAMW_EPS,
        adamw_weight_decay=ADAMW_WEIGHT_DECAY,
    )


def make_optimizer(name: str, model, dion):
    groups = bench_groups(model)
    if name == "dion_resident":
        return dion.Muon(groups, lr=MUON_LR)
    return Muon(groups, lr=MUON_LR, **MODES[name])


def cosine(i: int, total: int) -> float:
    """The lr factor of iteration ``i`` of ``total``: 1 down to 0.1 along half a cosine."""
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / total))


class Meter:
    """Times and memory on the device; on the CPU, host times and no memory readings."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def timed_step(self, opt):
        """Runs ``opt.step()``; returns a function that gives its seconds once the device is
        synchronized: CUDA events on the compute stream, or the host's clock on the CPU."""
        if not self.cuda:
            start = time.perf_counter()
            opt.step()
            seconds = time.perf_counter() - start
            return lambda: seconds
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        return lambda: start.elapsed_time(end) / 1e3

    def free(self) -> None:
        """As ``Clock.free`` (muon_offload/tools/bench/timing.py): on CUDA only, where the
        memory is read; on the CPU a collection costs seconds and frees nothing read."""
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()


def gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / GIB


def run_mode(name: str, args, cfg, tokens: torch.Tensor, device, dion) -> dict:
    meter = Meter(device)
    model = build_model(cfg, args.seed, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = make_optimizer(name, model, dion)
    base_lrs = [g["lr"] for g in opt.param_groups]
    total = args.warmup + args.iters
    iter_s, steps, losses = [], [], []
    step_added, held = 0, None
    meter.sync()
    meter.reset_peak()
    peak = 0
    for i in range(total):
        timed = i >= args.warmup
        for group, lr in zip(opt.param_groups, base_lrs, strict=True):
            group["lr"] = lr * cosine(i, total)
        meter.sync()
        start = time.perf_counter()
        loss = model(input_ids=tokens[i], labels=tokens[i]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if timed and meter.cuda:  # the step's own peak: the peak so far is kept aside
            peak = max(peak, meter.peak())
            meter.reset_peak()
            before = meter.allocated()
        step_seconds = meter.timed_step(opt)
        if timed and meter.cuda:
            step_added = max(step_added, meter.peak() - before)
        opt.zero_grad(set_to_none=True)
        meter.sync()
        seconds = time.perf_counter() - start
        losses.append(loss.item())
        if timed:
            iter_s.append(seconds)
            steps.append(step_seconds())
            held = meter.allocated()
    if meter.cuda:
        peak = max(peak, meter.peak())
    median = statistics.median(iter_s)
    row = {
        "median_iter_s": median,
        "min_iter_s": min(iter_s),
        "max_iter_s": max(iter_s),
        "median_step_s": statistics.median(steps),
        "tokens_per_s": tokens[0].numel() / median,
        "peak_gib": gib(peak) if meter.cuda else None,
        "peak_over_weights_grads_gib": gib(peak - 2 * weights) if meter.cuda else None,
        "step_peak_added_gib": gib(step_added) if meter.cuda else None,
        "held_over_weights_gib": gib(held - weights) if meter.cuda else None,
        "host_state_bytes": getattr(opt, "host_state_bytes", None),  # dion: None
        "host_state_gib": gib(getattr(opt, "host_state_bytes", None)),
        "last_loss": losses[-1],
        "losses": losses,
        "iter_s": iter_s,
        "step_s": steps,
    }
    del model, opt, loss
    return row


def environment(device: torch.device, args, cfg, counts: dict, dion) -> dict:
    import transformers

    info = {
        "card": machine.card(device),
        "driver": machine.driver_version() if device.type == "cuda" else None,
        **machine.versions(),
        "transformers": transformers.__version__,
        "dion": None,
        "date": machine.now(),
        "args": {k: str(v) if isinstance(v, torch.device) else v for k, v in vars(args).items()},
        "model": {
            "class": "Qwen3ForCausalLM",
            **{k: getattr(cfg, k) for k in MODEL},
            "tie_word_embeddings": False,
            "attn_implementation": "sdpa",
            **counts,
        },
        "state_dtype": "bf16 (the weights' dtype) but ours_offload_int8: int8",
    }
    if dion is not None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(dion.__file__)))
        info["dion"] = dion_commit(root) or root
    return info


def parameter_counts(cfg) -> dict:
    """Parameters in total and per group, counted on the meta device (nothing allocated)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    groups = muon_param_groups(model)
    per = {g["algorithm"]: sum(p.numel() for p in g["params"]) for g in groups}
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "muon_parameters": per.get("muon", 0),
        "adamw_parameters": per.get("adamw", 0),
    }


def table(results: dict) -> str:
    head = (
        f"{'mode':<18} {'iter s':>7} {'step s':>7} {'tok/s':>8} {'peak GiB':>8} "
        f"{'+w+g GiB':>8} {'step +GiB':>9} {'held GiB':>8} {'host GiB':>8} {'loss':>7}"
    )
    lines = [head]
    for name, r in results.items():
        if "median_iter_s" not in r:
            why = r.get("skipped") or r.get("error", "")
            lines.append(f"{name:<18} {'skipped' if 'skipped' in r else 'error'}: {why[:200]}")
            continue
        lines.append(
            f"{name:<18} {r['median_iter_s']:>7.3f} {r['median_step_s']:>7.4f} "
            f"{r['tokens_per_s']:>8.0f} {num(r['peak_gib'], '8.2f'):>8} "
            f"{num(r['peak_over_weights_grads_gib'], '8.2f'):>8} "
            f"{num(r['step_peak_added_gib'], '9.2f'):>9} "
            f"{num(r['held_over_weights_gib'], '8.2f'):>8} "
            f"{num(r['host_state_gib'], '8.2f'):>8} {r['last_loss']:>7.3f}"
        )
    return "\n".join(lines)


def parse(argv):
    ap = options.parser("transformers_step.py", __doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, 1 + 1 iterations")
    ap.add_argument(
        "--device",
        type=options.torch_device,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda where there is one)",
    )
    for key in ("batch", "seq", "warmup", "iters"):
        ap.add_argument(
            f"--{key}",
            type=int,
            default=None,
            help=f"default {DEFAULTS[key]}, {TINY_DEFAULTS[key]} with --tiny",
        )
    ap.add_argument("--layers", type=int, default=None, help="default 24, 2 with --tiny")
    ap.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="run these"
    )
    ap.add_argument("--dion-path", default=None, help="folder holding the dion package")
    ap.add_argument("--seed", type=int, default=0, help="model init and token ids")
    args = ap.parse_args(argv)
    for key, value in (TINY_DEFAULTS if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < (0 if key == "warmup" else 1):
            ap.error(f"--{key} must be >= {0 if key == 'warmup' else 1}")
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be >= 1")
    if args.device is None:
        args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options.check_device(ap, args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = args.device
    if device.type == "cuda":
        if device.index is None:  # torch 2.11's set_device refuses a bare "cuda"
            device = args.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    cfg = config(args)
    counts = parameter_counts(cfg)
    dion, dion_missing = import_dion(args.dion_path)
    print(
        f"Qwen3ForCausalLM, {counts['parameters']:,} parameters ({counts['muon_parameters']:,} "
        f"Muon, {counts['adamw_parameters']:,} AdamW), bf16; batch {args.batch} x seq "
        f"{args.seq}, {args.warmup} warm-up + {args.iters} timed iterations on {device}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.warmup + args.iters, args.batch, args.seq)
    tokens = torch.randint(cfg.vocab_size, shape, generator=gen).to(device)
    result = {"info": environment(device, args, cfg, counts, dion), "modes": {}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    meter = Meter(device)
    for name in args.modes:
        if name == "dion_resident" and dion is None:
            result["modes"][name] = {"skipped": dion_missing}
            print(f"{name}: skipped: {dion_missing}", flush=True)
        else:
            start = time.perf_counter()
            try:
                result["modes"][name] = run_mode(name, args, cfg, tokens, device, dion)
            except Exception as e:  # out of memory, above all: record it, run the next
                result["modes"][name] = {"error": f"{type(e).__name__}: {e}"[:4000]}
            meter.free()
            row = result["modes"][name]
            row["mode_wall_s"] = time.perf_counter() - start
            summary = row.get("error") or f"{row['median_iter_s']:.4f} s/iteration"
            print(f"{name}: {summary} ({row['mode_wall_s']:.1f} s)", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result["modes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
