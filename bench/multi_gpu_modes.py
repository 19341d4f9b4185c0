"""The modes of bench/multi_gpu.py on the sharded model: ours offloaded (fp32, bf16 and 8-bit
state) and resident (fp32 and 8-bit state), dion's resident ``Muon`` where dion runs here, and
the all-at-once offload baseline around dion's step (around ours without dion); each timed with
a barrier before every step, its figures the worst rank's. Offloaded modes also report each
rank's host state bytes as the optimizer reports them (8-bit: codes and scales)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from muon_offload import Muon
from muon_offload.tools.bench.modes import ADAMW_LR, MUON_LR, AllAtOnce
from muon_offload.tools.bench.timing import GIB, step_times

# bench/ is on sys.path when bench/multi_gpu.py runs as a script.
from moe_model import param_groups
from multi_gpu_ranks import barrier, everyone, over_ranks


def construct(make: Callable[[], object], ctx) -> tuple[object, int]:
    """The optimizer, built once memory is freed; and the memory allocated before it
    (weights and gradients), the base of its peak."""
    ctx.clock.free()
    barrier(ctx.clock)
    base = ctx.clock.allocated()
    return make(), base


def timed(step: Callable[[], object], ctx, warmup: int, base: int) -> dict:
    """Steps with a barrier before each, so a step starts on every rank at once; the figures
    over ranks."""
    before = lambda: barrier(ctx.clock)
    times = step_times(step, ctx.clock, warmup, ctx.args.steps, before_each=before)
    return over_ranks(times, ctx.clock, base)


def streamed_over_ranks(opt) -> dict:
    """Each rank's host state bytes (what its offloaded step streams each way) and the largest
    host state and staging arena over ranks. Every rank calls it."""
    host = everyone(opt.host_state_bytes)
    staging = everyone(opt.staging_bytes)
    return {
        "host_state_bytes_per_rank": host,
        "host_state_gib": max(host) / GIB,
        "staging_gib": max(staging) / GIB,
    }


def load_dion(args) -> tuple[object | None, str | None]:
    """(the dion module, None) or (None, why dion is left out). Its torch.compile'd functions
    run eagerly: TORCHDYNAMO_DISABLE is set at the top of bench/multi_gpu.py."""
    if args.no_dion:
        return None, "left out (--no-dion)"
    if args.dion_root is None:
        return None, args.dion_note
    if args.dion_root not in sys.path:
        sys.path.insert(0, args.dion_root)
    try:
        return importlib.import_module("dion"), None
    except Exception as err:  # an unimportable dion is a note in the results, not a failure
        return None, f"dion did not import from {args.dion_root}: {err!r}"


def has_list_all_to_all(mesh, device: torch.device) -> bool:
    """dion's Muon exchanges with the list-form all_to_all, which gloo has only from pytorch PR
    165435 (2026-04; torch 2.11 lacks it). A backend without it refuses the call on every rank
    alike, before anything is sent."""
    world = mesh.size()
    if world == 1:
        return True
    one = torch.zeros(1, device=device)
    try:
        dist.all_to_all(
            [torch.empty_like(one) for _ in range(world)],
            [one.clone() for _ in range(world)],
            group=mesh.get_group(),
        )
    except RuntimeError as err:
        if "does not support alltoall" in str(err):
            return False
        raise
    return True


def dion_groups(groups: list[dict]) -> list[dict]:
    """dion's Muon takes one mesh for every group. Its expert stacks are sharded only along
    their batch (expert) dim, which dion steps without communication and without checking
    their mesh, so the FSDP mesh serves all groups."""
    return [{k: v for k, v in g.items() if k != "distributed_mesh"} for g in groups]


def run_modes(ctx, specs, params, dion, dion_note: str | None, results: dict, progress) -> None:
    """Every mode of ``--modes`` on one model, in turn; results are written after each."""
    args, mesh = ctx.args, ctx.meshes["dense"]
    groups = param_groups(params, specs, ctx.meshes["experts"], ADAMW_LR)
    modes = results["modes"]

    def ours(**kw):
        return lambda: Muon(groups, distributed_mesh=mesh, lr=MUON_LR, **kw)

    ours_modes = {
        "ours_offload_fp32": ours(offload=True, chunk_bytes=args.chunk_bytes),
        "ours_offload_bf16": ours(
            offload=True, chunk_bytes=args.chunk_bytes, state_dtype=torch.bfloat16
        ),
        "ours_offload_int8": ours(
            offload=True, chunk_bytes=args.chunk_bytes, state_dtype=torch.int8
        ),
        "ours_resident": ours(),
        "ours_resident_int8": ours(state_dtype=torch.int8),
    }
    for name, make in ours_modes.items():
        if name in args.modes:
            progress(name)
            try:
                opt, base = construct(make, ctx)
            except ValueError as err:
                # The constructor's checks run before any collective and read only the groups,
                # alike on every rank: a refusal (a setting this model cannot take) is recorded.
                modes[name] = {"skipped": f"refused by the optimizer: {err}"}
                ctx.write(results)
                continue
            modes[name] = timed(opt.step, ctx, args.warmup, base)
            if name.startswith("ours_offload"):
                modes[name].update(streamed_over_ranks(opt))
            del opt
            ctx.write(results)

    if dion is None:
        modes["dion_resident"] = {"skipped": dion_note}
    if dion is not None:
        make = lambda: dion.Muon(dion_groups(groups), distributed_mesh=mesh, lr=MUON_LR)
        around = "dion_resident"
    else:  # the baseline still runs, around our resident step, and says so
        make, around = ours_modes["ours_resident"], "ours_resident"
    if dion is not None and "dion_resident" in args.modes:
        progress("dion_resident")
        opt, base = construct(make, ctx)
        modes["dion_resident"] = timed(opt.step, ctx, args.warmup, base)
        ctx.write(results)
    elif "all_at_once" in args.modes:
        progress(f"{around} (warm-up only), for the all-at-once baseline")
        opt, base = construct(make, ctx)
        for _ in range(args.warmup):  # creates the state that the baseline moves
            opt.step()
    else:
        return
    if "all_at_once" in args.modes:
        progress("all_at_once")
        baseline = AllAtOnce(opt, ("momentum", "variance"), pin=ctx.clock.cuda)
        # One warm-up step: the wrapped optimizer is warm already.
        modes["all_at_once"] = dict(timed(baseline.step, ctx, 1, base), around=around)
        del baseline
    del opt
    ctx.clock.free()
    ctx.write(results)
