"""The modes that ``muon-offload bench`` times on one copy of a workload: ours resident (fp32
and 8-bit state), ours offloaded (fp32, bf16 and 8-bit state, with one step's timeline and
chunk-size sweeps for fp32 and bf16), the all-at-once offload baseline, torch's fused AdamW and
torchao's ``CPUOffloadOptimizer`` on AdamW-only workloads; and what saving the offloaded
optimizer costs. Offloaded modes report the host bytes their state streams (read from the
optimizer, codes and scales for 8-bit state), from which the bench sets their floors."""

from __future__ import annotations

import importlib.util
import time

import torch

from ...distributed import local
from ..workloads import materialize
from .timing import GIB, MIB, Clock, time_steps

MODE_NAMES = (
    "ours_resident",
    "ours_resident_int8",
    "ours_offload_fp32",
    "ours_offload_bf16",
    "ours_offload_int8",
    "all_at_once",
    "torch_adamw_fused",
    "torchao_offload",
    "dion_resident",
)
MUON_LR, ADAMW_LR = 0.01, 1e-3
# AdamW's hyper-parameters in every mode and peer (ours, dion's, torch's fused AdamW, torchao's),
# so that their times compare like for like: Muon's defaults for its adamw groups.
ADAMW_BETAS, ADAMW_EPS, ADAMW_WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.01
TORCH_ADAMW = dict(lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=ADAMW_WEIGHT_DECAY)
TORCHAO_INSTALL = "pip install torchao==0.18.0"


def build(specs, device: torch.device, seed: int = 0):
    """Parameter groups as a training script would pass them (Muon matrices, an AdamW group),
    the fp32 state bytes of the workload, and the bytes of weights and gradients."""
    params = materialize(specs, device, seed=seed)
    muon = [p for p, s in zip(params, specs, strict=True) if s.algorithm == "muon"]
    adamw = [p for p, s in zip(params, specs, strict=True) if s.algorithm != "muon"]
    groups = []
    if muon:
        groups.append(dict(params=muon))
    if adamw:
        groups.append(
            dict(
                params=adamw,
                algorithm="adamw",
                lr=ADAMW_LR,
                beta1=ADAMW_BETAS[0],
                beta2=ADAMW_BETAS[1],
                epsilon=ADAMW_EPS,
                weight_decay=ADAMW_WEIGHT_DECAY,
            )
        )
    state = 4 * (sum(p.numel() for p in muon) + 2 * sum(p.numel() for p in adamw))
    weights_and_grads = sum(2 * p.numel() * p.element_size() for p in params)
    return groups, state, weights_and_grads


class AllAtOnce:
    """The all-at-once offload baseline around a resident optimizer (docs/benchmarks.md,
    "Workloads"): every state tensor copied from persistent (pinned, on a GPU) host buffers to
    the device, the step, and every one copied back. DTensor state is this rank's local
    tensors."""

    def __init__(self, opt, keys: tuple[str, ...], pin: bool):
        self.opt = opt
        self.state = [local(t) for s in opt.state.values() for k, t in s.items() if k in keys]
        self.host = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t) for t in self.state
        ]

    def step(self) -> None:
        for t, h in zip(self.state, self.host, strict=True):
            t.copy_(h, non_blocking=True)
        self.opt.step()
        for t, h in zip(self.state, self.host, strict=True):
            h.copy_(t, non_blocking=True)


def timeline(opt, clock: Clock) -> list[dict]:
    """One step's per-chunk stages (load, update, store), ms from the step's first mark: CUDA
    events on each stream on a GPU; on the CPU the stages run one after another."""
    clock.sync()
    with opt.timeline() as rows:
        opt.step()
    return rows


def state_dict_cost(opt, clock: Clock) -> dict:
    """What saving an offloaded optimizer costs: ``state_dict()`` itself, then reading every
    tensor it returns once (copied into one pageable buffer, as a serializer would), against
    reading the host buffers directly into the same buffer; and the GPU memory the call adds."""
    clock.sync()
    allocated = clock.allocated()
    clock.reset_peak()
    t = time.perf_counter()
    sd = opt.state_dict()
    call_s = time.perf_counter() - t
    clock.sync()
    peak = clock.peak()
    tensors = [v for vals in sd["state"].values() for v in vals.values() if torch.is_tensor(v)]
    # The state's bytes; the per-parameter step counts (0-d tensors) are not state to stream.
    nbytes = sum(v.numel() * v.element_size() for v in tensors if v.dim())
    host = opt.host_buffers()
    read = sum(v.numel() * v.element_size() for v in tensors)  # with the 0-d step counts
    buffer = torch.empty(max(read, sum(h.numel() for h in host)), dtype=torch.uint8)
    buffer.fill_(1)  # fault the pages in before timing

    def copy_all(sources) -> float:
        start, offset = time.perf_counter(), 0
        for src in sources:
            flat = src.reshape(-1).view(torch.uint8)
            buffer[offset : offset + flat.numel()].copy_(flat)
            offset += flat.numel()
        return time.perf_counter() - start

    return {
        "state_bytes": nbytes,
        "call_s": call_s,
        "read_through_state_dict_s": copy_all(tensors),
        "read_slabs_s": copy_all(host),
        "peak_added_bytes": peak - allocated if peak is not None else None,
        "threads": torch.get_num_threads(),
    }


def run_modes(specs, args, clock: Clock, progress, *, warmup: int, steps: int, full: bool):
    """Every one of our modes on one copy of the workload. ``full`` adds the timelines and the
    chunk-size sweeps (the main run); the memory-by-layers runs leave them out."""
    from ... import Muon

    device = torch.device(args.device)
    groups, state_bytes, base = build(specs, device)
    adamw_only = all(g.get("algorithm") == "adamw" for g in groups)
    out: dict = {"state_gib": state_bytes / GIB}

    def timed(name, opt, warm=warmup):
        progress(name)
        out[name] = time_steps(opt.step, clock, warm, steps, base)
        # Read after the warm-up, which creates the state; torch's optimizers stream nothing.
        if getattr(opt, "host_state_bytes", 0):
            out[name].update(streamed(opt))

    if not args.offload_only:
        timed("ours_resident", Muon(groups, lr=MUON_LR))
        clock.free()

    def sweep(opt, key):
        out[key] = {}
        for mib in args.chunk_mib:
            opt.reconfigure(chunk_bytes=max(1, round(mib * MIB)))
            clock.free()
            progress(f"{key} {mib:g} MiB")
            out[key][f"{mib:g}"] = time_steps(opt.step, clock, 1, steps, base)

    opt = Muon(groups, lr=MUON_LR, offload=True, chunk_bytes=args.chunk_bytes)
    timed("ours_offload_fp32", opt)
    if full:
        progress("state_dict")
        out["state_dict"] = state_dict_cost(opt, clock)
        out["timeline_fp32"] = timeline(opt, clock)
        sweep(opt, "chunk_sweep")
    opt.reconfigure(chunk_bytes=1 << 50)  # everything in one chunk
    clock.free()
    timed("all_at_once", opt, warm=1)
    del opt
    clock.free()

    opt = Muon(
        groups, lr=MUON_LR, offload=True, chunk_bytes=args.chunk_bytes, state_dtype=torch.bfloat16
    )
    timed("ours_offload_bf16", opt)
    if full:
        out["timeline_bf16"] = timeline(opt, clock)
        sweep(opt, "chunk_sweep_bf16")
    del opt
    clock.free()

    opt = Muon(
        groups, lr=MUON_LR, offload=True, chunk_bytes=args.chunk_bytes, state_dtype=torch.int8
    )
    timed("ours_offload_int8", opt)
    del opt
    clock.free()
    if full and not args.offload_only:
        timed("ours_resident_int8", Muon(groups, lr=MUON_LR, state_dtype=torch.int8))
        clock.free()

    params = [p for g in groups for p in g["params"]]
    if not adamw_only:
        why = "the workload has Muon parameters (compared on AdamW-only workloads)"
        out["torch_adamw_fused"] = {"skipped": f"not applicable: {why}"}
        out["torchao_offload"] = {"skipped": f"not applicable: {why}"}
        return out
    if not args.offload_only:
        timed("torch_adamw_fused", torch.optim.AdamW(params, fused=True, **TORCH_ADAMW))
        clock.free()
    if getattr(args, "torchao_offload", False):
        progress("torchao_offload")
        out["torchao_offload"] = {
            **time_steps(torchao_offload(params), clock, warmup, steps, base),
            # Each step moves the gradients to the host and the weights back.
            "streamed_bytes": sum(p.numel() * p.element_size() for p in params),
        }
        clock.free()
    else:
        out["torchao_offload"] = {
            "skipped": f"left out (--torchao-offload times it: a CUDA GPU and {TORCHAO_INSTALL})"
        }
    return out


def streamed(opt) -> dict:
    """What one of our offloaded optimizers streams each way a step: the host bytes of its state
    (codes and scales for 8-bit state), and its device staging arena."""
    return {
        "streamed_bytes": opt.host_state_bytes,
        "host_state_gib": opt.host_state_bytes / GIB,
        "staging_gib": opt.staging_bytes / GIB,
    }


def torchao_missing() -> str | None:
    """How to install torchao where it is not installed (None where it is)."""
    if importlib.util.find_spec("torchao") is None:
        return f"torchao is not installed: {TORCHAO_INSTALL}"
    return None


def torchao_offload(params: list[torch.nn.Parameter]):
    """The step of torchao's ``CPUOffloadOptimizer`` (fused AdamW on the host, state and fp32
    weights in pinned host memory) over ``params``, which need a CUDA GPU. torchao copies each
    gradient to the host in a hook that backward fires once the gradient is accumulated; the
    bench has no backward, so each step first adds zero to every gradient through autograd (in
    place: the values stay), which fires the hooks as training's backward would."""
    from torchao.optim import CPUOffloadOptimizer

    opt = CPUOffloadOptimizer(
        [dict(params=list(params))], torch.optim.AdamW, fused=True, **TORCH_ADAMW
    )
    zeros = [torch.zeros((), device=p.device, dtype=p.dtype).expand_as(p) for p in params]

    def step() -> None:
        accumulate_grads(params, zeros)
        opt.step()

    return step


def accumulate_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    """Adds ``grads`` to the parameters' gradients through autograd, as backward does, so that
    post-accumulate-grad hooks run."""
    torch.autograd.backward(params, grads)
