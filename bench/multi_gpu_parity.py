"""The parity check of bench/multi_gpu.py: K offloaded steps with small chunks on a smaller copy
of the distributed model against one process stepping the full tensors (on rank 0)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from muon_offload import Muon
from muon_offload.tools.bench.modes import ADAMW_LR, MUON_LR
from muon_offload.tools.bench.timing import MIB

# bench/ is on sys.path when bench/multi_gpu.py runs as a script.
from moe_model import PARITY_SEED, build_params, model_specs, param_groups, seed_of, set_grads

# The relative difference of a tensor's K-step update, ||ours - one process|| /
# ||one process - start||. On CPUs (gloo, 2 and 4 ranks) every tensor came out bitwise equal.
# On GPUs the sharded matrices (attention, router) may not: their norm is summed over the
# all-to-all'd whole in another order than the one process's fused prep kernel sums it, and a
# batch of another size may take other product kernels; the bf16 Polar Express results of two
# such paths differed by 0.4% to 0.6% relative RMS (kernels/orthogonalize.py). 2% leaves room
# for that and still catches a wrong shard pairing or a skipped or doubled update (~100%); an
# lr 1% off shows as 1%. Expert stacks (whole local matrices) and AdamW tensors take the same
# computation in both: whether they are bitwise equal is reported beside the tolerance.
PARITY_REL_TOL = 2e-2
# --parity-state-dtype: both runs keep this state. 8-bit state counts blocks over each rank's
# shard: where shards start on block boundaries (Qwen3's 2048 columns; the tiny embedding on 2
# ranks) both runs round the same blocks, and the bound above holds as for fp32; elsewhere the
# blocks differ (docs/design.md, 8-bit state under FSDP2).
STATE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "int8": torch.int8}
TINY_PARITY_CHUNK_BYTES = 512
# Small enough to cut a layer's state into dozens of chunks (each expert stack its own), large
# enough that the 311 MB embedding shard is not thousands of 64-element segments.
PARITY_CHUNK_BYTES = 4 * MIB


def full_copies(tensors, keep: bool) -> list[Tensor] | None:
    """Every DTensor gathered whole (a collective: every rank takes part); kept where ``keep``."""
    out = []
    with torch.no_grad():
        for t in tensors:
            whole = t.full_tensor()
            if keep:
                out.append(whole)
            del whole
    return out if keep else None


def parity(ctx, progress) -> dict | None:
    """K offloaded steps with small chunks on the distributed model against one process
    stepping the full tensors (gathered parameters and gradients, so both see exactly the same
    numbers) on rank 0's device. Returns rank 0's comparison, None elsewhere."""
    args = ctx.args
    progress(f"parity ({args.parity_steps} steps, {args.parity_layers} layers)")
    ctx.clock.free()
    specs = model_specs(ctx.dims, args.parity_layers)
    seed = seed_of(args.seed, PARITY_SEED)
    params = build_params(specs, ctx.meshes, ctx.device, seed=seed)
    root = dist.get_rank() == 0
    start = full_copies(params, keep=root)
    state_dtype = STATE_DTYPES[args.parity_state_dtype]
    opt = Muon(
        param_groups(params, specs, ctx.meshes["experts"], ADAMW_LR),
        distributed_mesh=ctx.meshes["dense"],
        lr=MUON_LR,
        offload=True,
        chunk_bytes=args.parity_chunk_bytes,
        state_dtype=state_dtype,
    )
    reference = [torch.nn.Parameter(t.clone()) for t in start] if root else None
    ref_opt = None
    if root:
        groups = param_groups(reference, specs, None, ADAMW_LR)
        ref_opt = Muon(groups, lr=MUON_LR, state_dtype=state_dtype)
    for k in range(args.parity_steps):
        set_grads(params, specs, seed, k)
        grads = full_copies([p.grad for p in params], keep=root)
        opt.step()
        if root:
            for q, g in zip(reference, grads, strict=True):
                q.grad = g
            ref_opt.step()
        del grads
    final = full_copies(params, keep=root)
    result = compare(specs, start, final, reference) if root else None
    del params, opt, reference, ref_opt, start, final
    ctx.clock.free()
    if result is not None:
        result.update(
            steps=args.parity_steps,
            layers=args.parity_layers,
            chunk_bytes=args.parity_chunk_bytes,
            state_dtype=args.parity_state_dtype,
            rel_tolerance=PARITY_REL_TOL,
        )
    return result


def compare(specs, start, ours, reference) -> dict:
    """Per role: the largest absolute difference of the parameters, the largest relative
    difference of a tensor's update, and whether every tensor is bitwise equal."""
    by_role: dict = {}
    for spec, x0, a, b in zip(specs, start, ours, reference, strict=True):
        b = b.detach()
        r = by_role.setdefault(
            spec.role,
            {"tensors": 0, "max_abs_diff": 0.0, "max_rel_update_diff": 0.0, "bitwise": True},
        )
        r["tensors"] += 1
        r["max_abs_diff"] = max(r["max_abs_diff"], (a - b).abs().max().item())
        rel = ((a - b).norm() / (b - x0).norm()).item()
        r["max_rel_update_diff"] = max(r["max_rel_update_diff"], rel)
        r["bitwise"] = r["bitwise"] and torch.equal(a, b)
    worst = max(r["max_rel_update_diff"] for r in by_role.values())
    return {
        "by_role": by_role,
        "max_abs_diff": max(r["max_abs_diff"] for r in by_role.values()),
        "max_rel_update_diff": worst,
        "within_tolerance": worst <= PARITY_REL_TOL,
    }


def parity_line(p: dict) -> str:
    """The parity result as one line of the table."""
    if "by_role" not in p:
        return f"parity: {p.get('skipped')}"
    roles = ", ".join(
        f"{role} {v['max_rel_update_diff']:.2e}{' (bitwise)' if v['bitwise'] else ''}"
        for role, v in p["by_role"].items()
    )
    verdict = "within" if p["within_tolerance"] else "OUTSIDE"
    return (
        f"parity, {p['steps']} offloaded steps ({p['layers']} layers, {p['chunk_bytes']} B "
        f"chunks, {p.get('state_dtype', 'fp32')} state) vs one process: max abs diff "
        f"{p['max_abs_diff']:.2e}; relative update diff {roles}; {verdict} "
        f"{p['rel_tolerance']:.0e}"
    )
