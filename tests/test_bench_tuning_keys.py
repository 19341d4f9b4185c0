"""bench/tuning_keys.py and kernels.tuning.recording_keys on the CPU: the keys a first step
tunes, recorded without a launch, the same on meta tensors as on real ones and for the
offloaded modes' stand-in (``as_streamed``) as for the streamed step; and how the shipped
table decides a key."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from _bench_import import import_bench

pytest.importorskip("transformers", reason='needs transformers: pip install -e ".[hf]"')
pytest.importorskip("triton")
from muon_offload.kernels import _launch, muon, quantized_muon, tuning  # noqa: E402

tuning_keys, training_loop, transformers_step = import_bench(
    "tuning_keys", "training_loop", "transformers_step"
)
OURS, config, build_model = training_loop.OURS, training_loop.config, transformers_step.build_model


def _model(kind: str, device: str):
    args = SimpleNamespace(tiny=True, layers=1, seq=16)
    return build_model(config(kind, args), 0, torch.device(device), torch.float32)


def test_recording_launches_nothing_and_restores_the_tuner_and_the_switches(monkeypatch):
    monkeypatch.delenv("MUON_OFFLOAD_TMA", raising=False)
    model = _model("moe", "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    keys = tuning_keys.first_step_keys(model)
    assert keys and all(name.count("|") >= 2 for name in keys)
    kernels = {name.split("|")[0] for name in keys}
    assert {"muon_prep", "sym_gram", "poly_apply", "adamw"} <= kernels  # CUDA's paths
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert "choose" not in vars(_launch.TUNER)
    assert "MUON_OFFLOAD_TMA" not in os.environ
    assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest's, as it was


@pytest.mark.parametrize("mode", [m for m in OURS if m not in training_loop.OPTIONAL])
def test_meta_tensors_and_the_streamed_stand_in_give_the_streamed_steps_keys(mode):
    """On real CPU tensors, the step as it runs (offload streamed through the CPU pipeline,
    cut at a small chunk_bytes) against the stand-in the full-size models take: meta
    tensors, the state resident in chunks of the same budget."""
    settings = dict(OURS[mode], chunk_bytes=96 << 10) if OURS[mode].get("offload") else OURS[mode]
    streamed = tuning_keys.first_step_keys(_model("moe", "cpu"), **settings)
    stand_in = tuning_keys.first_step_keys(
        _model("moe", "meta"), **tuning_keys.as_streamed(settings)
    )
    assert streamed == stand_in
    if mode == "ours_offload_fp32":  # the small chunks cut: not the default chunks' keys
        assert streamed != tuning_keys.first_step_keys(_model("moe", "cpu"), **OURS[mode])


def test_the_shipped_table_decides_exactly_by_a_nearer_class_or_not_at_all():
    table = tuning_keys.TABLE
    names = list(tuning.TUNER._shipped._table(table))
    exact = next(n for n in names if n.startswith("muon_prep|"))
    assert tuning.shipped_decision(table, exact, muon.PREP_CONFIGS) == ("exact", exact)
    fields = exact.split("|")
    fields[4] = str(int(fields[4]) * 1024)  # another size class of the same fields
    how, source = tuning.shipped_decision(table, "|".join(fields), muon.PREP_CONFIGS)
    assert how == "nearest" and source in names and source.startswith("muon_prep|")
    unseen = "muon_prep8|float32|bfloat16|(3, 5)|False"  # 8-bit prep keys hold the shape
    assert tuning.shipped_decision(table, unseen, quantized_muon.PREP_CONFIGS) == ("timed", None)


def test_the_script_lists_the_keys_the_table_lacks(tmp_path, capsys):
    out = tmp_path / "keys.json"
    assert tuning_keys.main(["--tiny", "--models", "moe", "--layers", "1", "--json", str(out)]) == 0
    lines = [line[10:] for line in capsys.readouterr().out.splitlines() if line[:2] == "  "]
    listed = {line.split("  [")[0].split(" <- ")[0] for line in lines}  # "  how     key <- ..."
    rows = json.loads(out.read_text())["moe"]
    for name, row in rows.items():
        assert row["shipped"] in ("exact", "nearest", "timed")
        assert set(row["modes"]) <= set(OURS)
        assert (name in listed) == (row["shipped"] != "exact")
