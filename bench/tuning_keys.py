"""The tuning keys that bench/training_loop.py's models need in their first step, and how the
shipped table of a GPU decides each: on the CPU, nothing timed or launched.

    python bench/tuning_keys.py --models moe dense  # full size, on meta tensors
    python bench/tuning_keys.py --tiny --json out/tuning_keys_tiny.json

For each model and each of our modes (resident, offloaded with fp32 state, offloaded with int8
state: training_loop.py's ``OURS``) one ``step()`` runs with ``backend="triton"`` inside
``kernels.tuning.recording_keys``: every tuned launch records its key and launches nothing,
as on a GPU with TMA. Full-size models are built on the meta device (no weights allocated;
the offloaded modes' state kept resident in chunks of their ``chunk_bytes``, the plan they
stream: ``as_streamed``), ``--tiny`` ones on the CPU. Each key is
then looked up in the shipped table (``--table``, a file of ``kernels/tuned/``) as the tuner
does where the user's cache lacks it: "exact", "nearest" (an entry of another size class of
the same kernel and fields decides it, untimed) or "timed" (none does: the step times every
candidate on the card, and prints "timing kernel configs for shapes new to this GPU"). The
table's entries must be timed on the card (``muon-offload tune``), never written from here.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch
from muon_offload.kernels import tuning
from training_loop import MODELS, OURS, config
from transformers_step import MUON_LR, bench_groups, build_model

from muon_offload import Muon
from muon_offload.engine.settings import default_chunk_bytes

TABLE = "tune-NVIDIA_H200-triton3.6.0.json"


def as_streamed(settings: dict) -> dict:
    """``settings`` with the state resident, cut into chunks as ``offload=True`` streams it
    (``chunk_bytes``, by default as ``Settings`` derives it from the state dtype and
    ``cuda_graph``): the same units and chunks, so the same launches and keys
    (tests/test_bench_tuning_keys.py checks it), without host state, which meta tensors
    cannot be carved from."""
    if not settings.get("offload"):
        return settings
    chunk_bytes = settings.get("chunk_bytes") or default_chunk_bytes(
        settings.get("state_dtype"), settings.get("cuda_graph", "auto"), batches_matrices=True
    )  # Muon's
    rest = {k: v for k, v in settings.items() if k not in ("offload", "chunk_bytes")}
    return dict(rest, offload=False, resident_chunk_bytes=chunk_bytes)


def first_step_keys(model: torch.nn.Module, **settings) -> dict[str, tuple]:
    """{key: candidates} that one ``step()`` of ``Muon(bench_groups(model), **settings)``
    tunes, its gradients zeros of the parameters' shapes (fp32, as the training loop's)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = Muon(bench_groups(model), lr=MUON_LR, backend="triton", **settings)
    with tuning.recording_keys() as keys:
        opt.step()
    for p in model.parameters():
        p.grad = None
    return keys


def model_keys(kind: str, tiny: bool, layers: int | None, table: str) -> dict:
    """{key: {"modes": [...], "shipped": exact / nearest / timed, "from": the table's key}}."""
    args = SimpleNamespace(tiny=tiny, layers=layers, seq=1024)
    device = torch.device("cpu" if tiny else "meta")
    rows: dict[str, dict] = {}
    for mode, settings in OURS.items():
        model = build_model(config(kind, args), 0, device, torch.float32)
        if device.type == "meta":
            settings = as_streamed(settings)
        for name, configs in first_step_keys(model, **settings).items():
            row = rows.get(name)
            if row is None:
                how, source = tuning.shipped_decision(table, name, configs)
                row = rows[name] = {"modes": [], "shipped": how, "from": source}
            row["modes"].append(mode)
        del model
    return dict(sorted(rows.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("tuning_keys.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--tiny", action="store_true", help="the tiny models, on the CPU")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's")
    ap.add_argument("--table", default=TABLE, help=f"shipped table (default {TABLE})")
    ap.add_argument("--json", default=None, help="also write the keys to this JSON file")
    args = ap.parse_args(argv)
    out = {}
    for kind in args.models:
        rows = out[kind] = model_keys(kind, args.tiny, args.layers, args.table)
        timed = [k for k, r in rows.items() if r["shipped"] == "timed"]
        nearest = [k for k, r in rows.items() if r["shipped"] == "nearest"]
        print(f"{kind}: {len(rows)} keys; {len(timed)} timed on the card, {len(nearest)} nearest")
        for name, row in rows.items():
            if row["shipped"] != "exact":
                source = f" <- {row['from']}" if row["from"] else ""
                print(f"  {row['shipped']:7} {name}{source}  [{', '.join(row['modes'])}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
