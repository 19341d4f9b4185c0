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
