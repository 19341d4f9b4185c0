"""``muon-offload bench``'s run, once its arguments are parsed (command.py): every mode on the
workload and at each layer count, the bandwidths and floors, dion in a subprocess."""

from __future__ import annotations

import torch

from ..workloads import workload
from . import machine
from .dion_runner import dion_commit, run_dion
from .modes import MODE_NAMES, run_modes
from .progress import Progress
from .report import add_ratios
from .timing import GIB, STATE_DTYPES, Clock, bandwidths, floor_s

NO_GPU = "no CUDA GPU: nothing crosses PCIe, and peak GPU memory is not measured"


def environment(args) -> dict:
    device = torch.device(args.device)
    return {
        "card": machine.card(device),
        "device": args.device,
        "driver": machine.driver_version(),
        **machine.versions(),
        "cpu_threads": torch.get_num_threads(),
        "dion_commit": dion_commit(args.dion_root) if args.dion_root else None,
        "date": machine.now(),
        "args": dict(vars(args)),
    }


def add_floors(modes: dict, bandwidth: dict | None) -> None:
    """Each offloaded mode's transfer floor, from the bytes it reports streaming each way."""
    for m in modes.values():
        if "streamed_bytes" in m:
            m["floor_s"] = floor_s(m["streamed_bytes"], bandwidth)


def ratios(results: dict) -> None:
    """Each mode's median over its transfer floor and over dion's resident median."""
    floors = {"dion_all_at_once": results["floor"]["fp32"]["floor_s"]}
    floors.update({k: results[k].get("floor_s") for k in MODE_NAMES if k in results})
    dion = results.get("dion_resident", {})
    modes = [(k, results[k]) for k in MODE_NAMES if "median_s" in results.get(k, {})]
    if "median_s" in dion.get("all_at_once", {}):
        modes.append(("dion_all_at_once", dion["all_at_once"]))
    add_ratios(modes, floors, dion)


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = Clock(device)
    use_dion = args.dion_root is not None
    others = [n for n in args.memory_layers if n != args.layers]
    stages = 8 + 2 * len(args.chunk_mib) + 5 * len(others) + use_dion + (device.type == "cuda")
    stages += args.torchao_offload
    progress = Progress(stages)
    results: dict = {"info": environment(args)}
    if clock.cuda:
        progress("bandwidths")
        results["bandwidth_gbps"] = bandwidths()
        clock.free()
    else:
        results["bandwidth_gbps"] = None
        results["bandwidth_note"] = NO_GPU

    def stage(layers):
        return lambda name: progress(f"{args.workload} {layers} layers: {name}")

    specs = workload(args.workload, args.layers)
    main = run_modes(
        specs, args, clock, stage(args.layers), warmup=args.warmup, steps=args.steps, full=True
    )
    state = main.pop("state_gib") * GIB
    bw = results["bandwidth_gbps"]
    results["floor"] = {
        name: {"state_gib": state * k / GIB, "floor_s": floor_s(state * k, bw)}
        for name, k in STATE_DTYPES
    }
    # 8-bit state's bytes depend on the format (codes, block scales, small tensors dense): the
    # host bytes the optimizer reports.
    int8 = main["ours_offload_int8"]["streamed_bytes"]
    results["floor"]["int8"] = {"state_gib": int8 / GIB, "floor_s": floor_s(int8, bw)}
    if not bw:
        results["floor_note"] = NO_GPU
    results.update(main)
    add_floors({k: main[k] for k in MODE_NAMES if k in main}, bw)

    memory = {}
    for layers in args.memory_layers:
        if layers == args.layers:
            modes = {k: main[k] for k in MODE_NAMES if k in main}
            memory[layers] = {"state_gib": state / GIB, "modes": modes}
        else:
            r = run_modes(
                workload(args.workload, layers),
                args,
                clock,
                stage(layers),
                warmup=2,
                steps=3,
                full=False,
            )
            memory[layers] = {"state_gib": r.pop("state_gib"), "modes": r}
        add_floors(memory[layers]["modes"], bw)
        # The offloaded fp32 figures at the top level, where earlier runs kept them.
        memory[layers].update(memory[layers]["modes"]["ours_offload_fp32"])
    results["memory_by_layers"] = memory

    if use_dion and not args.offload_only:
        progress("dion (eager, subprocess)")
        runs = [dict(layers=args.layers, warmup=args.warmup, steps=args.steps)]
        runs += [dict(layers=n, warmup=2, steps=3) for n in others]
        dion = run_dion(args, args.dion_root, runs)
        results["dion_resident"] = dict(dion[0], commit=results["info"]["dion_commit"])
        for n, r in zip(others, dion[1:], strict=True):
            memory[n]["modes"]["dion_resident"] = r
        if args.layers in memory:
            memory[args.layers]["modes"]["dion_resident"] = results["dion_resident"]
    else:
        note = "left out (--offload-only)" if use_dion else args.dion_note
        results["dion_resident"] = {"skipped": note}
    ratios(results)
    progress("figures")
    progress.close()
    return results
