"""``muon-offload demo``: train a small GPT-like model with offloaded Muon and with resident
Muon side by side, and show both losses falling together.

Runs on whatever device exists: on a GPU the state streams from pinned host memory; on a
CPU-only machine the same chunked pipeline runs through its CPU path. Closes with each mode's
median step time and whether the two loss curves agree (exit status 1 where they do not).
"""

from __future__ import annotations

import math
import statistics
import time

from . import options

DESCRIPTION = (
    "Train a small GPT-like model with offloaded Muon and with resident Muon side by side, "
    "and show both losses falling together."
)
# The two runs' optimizers compute the same bits from the same gradients (docs/design.md);
# the model's forward and backward need not be bitwise reproducible on a GPU (atomics), so the
# curves are judged to agree within this relative difference at every step.
LOSS_RTOL = 1e-3


def agreement(resident: list[float], offloaded: list[float], rtol: float = LOSS_RTOL):
    """Whether the two loss curves agree at every step (bitwise, or within ``rtol`` relative;
    a NaN never agrees), and the sentence that says so."""
    steps = len(resident)
    if resident == offloaded and all(map(math.isfinite, resident)):
        return True, f"loss curves: bitwise equal at all {steps} steps"
    rel = [
        abs(a - b) / max(abs(a), abs(b), 1e-30) if math.isfinite(a - b) else math.inf
        for a, b in zip(resident, offloaded, strict=True)
    ]
    worst = max(range(steps), key=rel.__getitem__)
    what = f"largest relative difference {rel[worst]:.1e} at step {worst + 1}"
    if rel[worst] <= rtol:
        return True, f"loss curves: agree within relative {rtol:g} at all {steps} steps ({what})"
    return False, f"loss curves: DIFFER, {what}, over the relative tolerance {rtol:g}"


def step_times(names: list[str], times: list[list[float]]) -> list[str]:
    """Each mode's median step time, over the steps after the first (which also makes the state
    and compiles or tunes the kernels: shown beside it), as table lines."""
    steps = len(times[0])
    which = f"median of steps 2-{steps}" if steps > 1 else "median of 1 step"
    lines = [f"{'step time':<10} {which:>22} {'first step':>12}"]
    for name, t in zip(names, times, strict=True):
        median = statistics.median(t[1:] or t)
        lines.append(f"{name:<10} {median * 1e3:>19.2f} ms {t[0] * 1e3:>9.2f} ms")
    return lines


def parser():
    ap = options.parser("muon-offload demo", DESCRIPTION)
    ap.add_argument("--steps", type=int, default=200, help="training steps")
    ap.add_argument(
        "--device",
        type=options.torch_device,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda where a GPU is available, else cpu)",
    )
    ap.add_argument(
        "--chunk-bytes",
        type=int,
        default=256 << 10,
        help="the offloaded optimizer's chunk size, small so that even this model streams in "
        "many pieces",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    import torch  # after the arguments: --help answers without it
    from torch import nn

    from .. import Muon
    from .demo_model import TinyGPT, markov_batches, param_groups

    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.chunk_bytes < 1:
        ap.error("--chunk-bytes must be >= 1")
    if args.device is None:
        args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options.check_device(ap, args.device)
    device = args.device
    vocab, dim, layers, heads, seq, batch = 64, 64, 2, 4, 32, 16

    torch.manual_seed(0)
    models = [TinyGPT(vocab, dim, layers, heads, seq).to(device) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [
        Muon(param_groups(models[0]), lr=0.02),
        Muon(param_groups(models[1]), lr=0.02, offload=True, chunk_bytes=args.chunk_bytes),
    ]
    print(
        f"device {device}; {sum(p.numel() for p in models[0].parameters()):,} parameters; "
        f"offloaded chunks of {args.chunk_bytes:,} bytes",
        flush=True,
    )
    data = markov_batches(vocab, seq, batch, seed=1)
    loss_fn = nn.CrossEntropyLoss()
    losses, times = ([[], []] for _ in range(2))  # [resident, offloaded], one entry a step
    for step in range(1, args.steps + 1):
        tokens = next(data).to(device)
        for i, (model, opt) in enumerate(zip(models, optimizers, strict=True)):
            logits = model(tokens[:, :-1])
            loss = loss_fn(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[i].append(time.perf_counter() - start)
            opt.zero_grad(set_to_none=True)
            losses[i].append(loss.item())
        if step == 1:
            # After the first step: the optimizer's one-time notices (the CPU path of
            # offload=True, oversized chunks) are logged in it, so they land above the table.
            print(f"{'step':>5} {'loss resident':>14} {'loss offloaded':>15}")
        if step == 1 or step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(f"{step:>5} {losses[0][-1]:>14.4f} {losses[1][-1]:>15.4f}", flush=True)
    state_bytes = sum(
        t.numel() * t.element_size() for s in optimizers[1].state.values() for t in s.values()
    )
    where = "pinned host" if device.type == "cuda" else "host"
    print(f"offloaded optimizer state: {state_bytes / 2**20:.2f} MiB in {where} memory")
    print("\n".join(step_times(["resident", "offloaded"], times)))
    agree, sentence = agreement(*losses)
    print(sentence)
    return 0 if agree else 1
