"""The tuning surface the tools use (muon_offload.kernels.tuning), on the CPU."""

from __future__ import annotations

import torch
from _kernel_utils import tuning_as_on_a_gpu
from muon_offload.kernels import _launch, tuning


def test_retuning_is_scoped_and_restored_after_an_error():
    assert _launch.TUNER.retune is False
    try:
        with tuning.retuning():
            assert _launch.TUNER.retune is True
            raise KeyError("inside")
    except KeyError:
        pass
    assert _launch.TUNER.retune is False


def test_last_choice_reads_what_the_tuner_chose(monkeypatch, tmp_path):
    tuner = tuning_as_on_a_gpu(monkeypatch, tmp_path)
    monkeypatch.setattr(_launch, "TUNER", tuner)
    monkeypatch.setattr(tuning, "TUNER", tuner)
    assert tuning.last_choice("k") is None
    configs = [_launch.Config(block=256), _launch.Config(block=512, num_warps=8)]
    times = {256: 2.0, 512: 1.5}
    tuner.choose("k", ("x",), configs, configs[0], torch.device("cuda"), lambda c: times[c.block])
    assert tuning.last_choice("k") == ("block=512 warps=8", 1.5)


def test_a_cached_decision_outside_the_candidates_is_tuned_again(monkeypatch, tmp_path):
    """The disk cache is shared by every version of the package on the machine: an entry
    written by another version (a config field this one does not know, a config no longer
    offered, a malformed entry) must not fail the step nor bypass the candidates; the key is
    tuned again among today's configs and the entry replaced. (Found on the H200: a version
    whose Config had no ``flatten`` field raised TypeError inside step() on a cache written
    by a newer one.)"""
    import json

    tuner = tuning_as_on_a_gpu(monkeypatch, tmp_path)
    configs = [_launch.Config(block=256), _launch.Config(block=512, num_warps=8)]
    times = {256: 2.0, 512: 1.5}
    stale = {
        "k|unknown": {"config": {"block": 512, "not_a_field": 1}, "ms": 1.0},
        "k|retired": {"config": {"block": 1024, "num_warps": 8}, "ms": 1.0},
        "k|malformed": {"ms": 1.0},
        "k|kept": {"config": {"block": 256}, "ms": 1.0},
    }
    (tmp_path / "t.json").write_text(json.dumps(stale))
    timed = []

    def bench(config):
        timed.append(config)
        return times[config.block]

    dev = torch.device("cuda")
    for key in ("unknown", "retired", "malformed"):
        timed.clear()
        chosen = tuner.choose("k", (key,), configs, configs[0], dev, bench)
        assert chosen == configs[1] and timed == configs, key
        saved = json.loads((tmp_path / "t.json").read_text())[f"k|{key}"]
        assert _launch.Config(**saved["config"]) == configs[1]
    timed.clear()
    # A cached decision among the candidates is used as it is, untimed (even if slower).
    assert tuner.choose("k", ("kept",), configs, configs[0], dev, bench) == configs[0]
    assert timed == []
