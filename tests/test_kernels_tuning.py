"""The tuning surface the tools use (muon_offload.kernels.tuning), on the CPU."""

from __future__ import annotations

import torch
from _kernel_utils import tuning_as_on_a_gpu
from muon_offload.kernels import _launch, shape_classes, shipped_tables, tuning


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


def test_forcing_takes_the_config_untimed_and_refuses_one_the_launch_lacks(monkeypatch, tmp_path):
    import json

    import pytest

    tuner = tuning_as_on_a_gpu(monkeypatch, tmp_path)
    monkeypatch.setattr(tuning, "TUNER", tuner)
    configs = [_launch.Config(block=256), _launch.Config(block=512, num_warps=8)]
    cached = {"k|x": {"config": {"block": 512, "num_warps": 8}, "ms": 1.0}}
    (tmp_path / "t.json").write_text(json.dumps(cached))
    dev = torch.device("cuda")

    def bench(config):
        raise AssertionError("a forced launch times nothing")

    monkeypatch.setenv("MUON_OFFLOAD_AUTOTUNE", "0")  # forcing holds with tuning off too
    with tuning.forcing("k", configs[0]):
        assert tuner.choose("k", ("x",), configs, configs[1], dev, bench) == configs[0]
        assert tuner.choose("other", ("x",), configs, configs[1], dev, bench) == configs[0]
        lacking = "cannot take block=128 .*candidates: block=256 warps=4, block=512"
        absent = _launch.Config(block=128)
        with pytest.raises(ValueError, match=lacking), tuning.forcing("k", absent):
            tuner.choose("k", ("x",), configs, configs[1], dev, bench)
        assert tuner.forced == {"k": configs[0]}  # the inner block's config left with it
    assert tuner.forced == {}
    monkeypatch.setenv("MUON_OFFLOAD_AUTOTUNE", "1")
    assert tuner.choose("k", ("x",), configs, configs[0], dev, bench) == configs[1]  # the cache's
    assert json.loads((tmp_path / "t.json").read_text()) == cached  # nothing written


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


def test_shape_classes():
    assert [shape_classes.shape_class(n) for n in (1, 5, 17, 64, 100, 128)] == [
        1,
        8,
        32,
        64,
        128,
        128,
    ]
    # Past 128, multiples of 128: the bench workloads' dimensions are their own classes.
    assert [shape_classes.shape_class(n) for n in (129, 333, 768, 1000, 2048)] == [
        256,
        384,
        768,
        1024,
        2048,
    ]


def test_fitting_drops_tiles_larger_than_the_class_and_tma_below_its_rows():
    from muon_offload.kernels.gram import GRAM_CONFIGS
    from muon_offload.kernels.poly_apply import POLY_APPLY_CONFIGS

    small = shape_classes.fitting(GRAM_CONFIGS, 64)
    assert small and all(c.block == 64 and not c.tma for c in small)
    assert set(shape_classes.fitting(GRAM_CONFIGS, 2048)) == set(GRAM_CONFIGS)
    mid = shape_classes.fitting(GRAM_CONFIGS, 384)
    assert not any(c.tma for c in mid) and any(c.block == 128 for c in mid)
    wide = shape_classes.fitting(POLY_APPLY_CONFIGS, 128, 4096)
    assert {c.block_m for c in wide} == {64, 128} and not any(c.tma for c in wide)
    narrow = shape_classes.fitting(POLY_APPLY_CONFIGS, 1024, 128)
    assert all(c.block <= 128 for c in narrow) and any(c.tma for c in narrow)
    # A class smaller than every tile keeps the smallest-tiled candidates, never none.
    tiny = shape_classes.fitting(POLY_APPLY_CONFIGS, 8, 8)
    assert tiny and {(c.block_m, c.block) for c in tiny} in ({(64, 256)}, {(128, 64)})


def _shipped(monkeypatch, tmp_path, table):
    """A tuner as on a GPU whose shipped table (for the cache file's name) is ``table``."""
    import json

    tuner = tuning_as_on_a_gpu(monkeypatch, tmp_path)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "t.json").write_text(json.dumps(table))
    monkeypatch.setattr(shipped_tables, "SHIPPED_DIR", shipped)
    return tuner


def test_shipped_table_decides_its_class_and_the_nearest_class_untimed(monkeypatch, tmp_path):
    configs = [_launch.Config(block=64), _launch.Config(block=128), _launch.Config(block=256)]
    table = {
        "k|bf16|768|2048|True": {"config": {"block": 128}, "ms": 1.0},
        "k|bf16|4096|8192|True": {"config": {"block": 256}, "ms": 1.0},
        "k|bf16|768|2048|False": {"config": {"block": 64}, "ms": 1.0},
        "other|bf16|1000|1024|True": {"config": {"block": 64}, "ms": 1.0},
    }
    tuner = _shipped(monkeypatch, tmp_path, table)
    timed = []

    def bench(config):
        timed.append(config)
        return float(config.block)

    dev = torch.device("cuda")
    assert (
        tuner.choose("k", ("bf16", 768, 2048, True), configs, configs[0], dev, bench)
        == (configs[1])
    )
    # A class the table lacks takes the nearest class with the same other fields (log2 sizes).
    assert (
        tuner.choose("k", ("bf16", 1024, 2048, True), configs, configs[0], dev, bench)
        == (configs[1])
    )
    assert (
        tuner.choose("k", ("bf16", 3072, 8192, True), configs, configs[0], dev, bench)
        == (configs[2])
    )
    assert (
        tuner.choose("k", ("bf16", 1024, 4096, False), configs, configs[0], dev, bench)
        == (configs[0])
    )
    assert timed == []
    # No entry of the kernel with these other fields: timed, and the fastest kept.
    assert (
        tuner.choose("k", ("fp16", 768, 2048, True), configs, configs[0], dev, bench)
        == (configs[0])
    )
    assert timed == configs
    # A shipped config that is not a candidate here is passed over.
    timed.clear()
    only = [configs[0], configs[2]]
    assert tuner.choose("k", ("bf16", 640, 2048, True), only, only[0], dev, bench) in only
    assert timed == []  # the 4096 x 8192 class's entry (256) is a candidate


def test_user_cache_and_retuning_come_before_the_shipped_table(monkeypatch, tmp_path):
    import json

    configs = [_launch.Config(block=64), _launch.Config(block=128)]
    tuner = _shipped(monkeypatch, tmp_path, {"k|a|256": {"config": {"block": 128}, "ms": 1.0}})
    (tmp_path / "t.json").write_text(json.dumps({"k|a|256": {"config": {"block": 64}}}))
    dev = torch.device("cuda")
    assert tuner.choose("k", ("a", 256), configs, configs[0], dev, lambda c: 1.0) == configs[0]
    with tuning.retuning():
        chosen = tuner.choose("k", ("a", 256), configs, configs[0], dev, lambda c: c.block)
    assert chosen == configs[0]  # timed again: 64 ms < 128 ms


def test_the_first_tuning_of_a_process_says_so_once(monkeypatch, tmp_path, caplog):
    import logging

    tuner = tuning_as_on_a_gpu(monkeypatch, tmp_path)
    configs = [_launch.Config(block=64), _launch.Config(block=128)]
    dev = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="muon_offload"):
        for key in (("a",), ("a",), ("b",)):
            tuner.choose("k", key, configs, configs[0], dev, lambda c: 1.0)
    notices = [r for r in caplog.records if "timing kernel configs" in r.getMessage()]
    assert len(notices) == 1
    assert "MUON_OFFLOAD_AUTOTUNE=0" in notices[0].getMessage()
    assert str(tmp_path / "t.json") in notices[0].getMessage()  # the file names the GPU


def test_products_time_the_class_not_the_call(monkeypatch):
    """Two shapes of one class get one key, and the timing runs on the class's sizes in the
    call's layout: the choice cannot depend on which shape of the class came first."""
    from muon_offload.kernels import gram, poly_apply

    seen = []

    def choose(kernel, key, configs, interpreter_config, device, bench, force=False):
        seen.append((kernel, key))
        bench(interpreter_config)
        return interpreter_config

    launched = []
    monkeypatch.setattr(_launch.TUNER, "choose", choose)
    monkeypatch.setattr(gram, "bench_ms", lambda fn: fn() or 0.0)
    monkeypatch.setattr(poly_apply, "bench_ms", lambda fn: fn() or 0.0)
    monkeypatch.setattr(_launch, "interpreted", lambda: False)

    def spy_gram(x, w, *args, **kwargs):  # records the launch, runs nothing
        launched.append(("sym_gram", tuple(x.shape[1:]), x.stride(-1) == 1))

    def spy_poly(poly, x, *args, **kwargs):
        launched.append(("poly_apply", tuple(x.shape[1:]), x.stride(-1) == 1))

    monkeypatch.setattr(gram, "_launch", spy_gram)
    monkeypatch.setattr(poly_apply, "_launch", spy_poly)
    for m, k in ((300, 40), (333, 57)):
        x = torch.randn(2, k, m).mT  # [2, m, k], columns contiguous
        gram.sym_gram(x)
        poly_apply.poly_apply(torch.randn(2, m, m), x.contiguous(), alpha=0.5)
    keys = {kernel: {key for kk, key in seen if kk == kernel} for kernel, _ in seen}
    assert all(len(v) == 1 for v in keys.values()), keys
    benched = [entry for i, entry in enumerate(launched) if i % 2 == 0]
    assert set(benched) == {("sym_gram", (384, 64), False), ("poly_apply", (384, 64), True)}


def test_shipped_tables_name_todays_candidates():
    """Every decision a shipped table holds is a config some kernel offers today: a table
    whose configs were retired would be passed over and the GPU would tune again."""
    import importlib
    import json
    import pkgutil

    import muon_offload.kernels

    offered = set()
    for info in pkgutil.iter_modules(muon_offload.kernels.__path__):
        module = importlib.import_module(f"muon_offload.kernels.{info.name}")
        for value in vars(module).values():
            if isinstance(value, tuple) and value and isinstance(value[0], _launch.Config):
                offered.update(value)
    tables = sorted(shipped_tables.SHIPPED_DIR.glob("tune-*-triton*.json"))
    assert tables, "no shipped table"
    for path in tables:
        for name, entry in json.loads(path.read_text()).items():
            assert _launch.Config(**entry["config"]) in offered, (path.name, name)


def test_a_single_candidate_is_taken_untimed_unless_retuning(monkeypatch, tmp_path):
    """One candidate leaves nothing to choose: no timing, and inside the compile pass no
    scratch launch compiled for one; ``muon-offload tune`` (retuning) still times it."""
    tuner = tuning_as_on_a_gpu(monkeypatch, tmp_path)
    only = (_launch.Config(block=256),)
    timed = []

    def bench(config):
        timed.append(config)
        return 1.0

    dev = torch.device("cuda")
    assert tuner.choose("k", ("x",), only, only[0], dev, bench) == only[0]
    _launch.AHEAD.on = True
    try:
        assert tuner.choices("k", ("y",), only, only[0], dev, bench) == only
    finally:
        _launch.AHEAD.on = False
    assert timed == [] and not (tmp_path / "t.json").exists()
    tuner.retune = True
    assert tuner.choose("k", ("x",), only, only[0], dev, bench) == only[0]
    assert timed == list(only)


def test_a_product_one_smallest_tile_covers_is_not_timed(monkeypatch):
    """The products' keys whose output one smallest tile covers get no timing (each matrix
    one program whatever the tiles): the launcher hands the tuner no bench; larger ones do."""
    from muon_offload.kernels import gram, poly_apply

    benches = {}

    def choose(kernel, key, configs, interpreter_config, device, bench, force=False):
        benches[(kernel, *key[2:4])] = bench is not None
        return interpreter_config

    monkeypatch.setattr(_launch.TUNER, "choose", choose)
    monkeypatch.setattr(_launch, "interpreted", lambda: False)
    monkeypatch.setattr(gram, "_launch", lambda *args, **kwargs: None)
    monkeypatch.setattr(poly_apply, "_launch", lambda *args, **kwargs: None)
    for m, k in ((17, 4097), (64, 64), (65, 64), (300, 40)):
        x = torch.randn(2, m, k)
        gram.sym_gram(x)
        poly_apply.poly_apply(torch.randn(2, m, m), x, alpha=0.5)
    assert not benches["sym_gram", 32, 8192] and not benches["sym_gram", 64, 64]
    assert benches["sym_gram", 128, 64] and benches["sym_gram", 384, 64]
    assert not benches["poly_apply", 64, 64]
    assert benches["poly_apply", 32, 8192] and benches["poly_apply", 128, 64]


def test_a_steps_timing_is_shorter_than_the_tune_commands(monkeypatch):
    """A step's tuning (the step waits for it) times each candidate for STEP_BENCH_MS;
    ``muon-offload tune`` (retuning, ahead of training) for the longer TUNE_BENCH_MS."""
    import triton.testing

    asked = []

    def do_bench(fn, warmup, rep, return_mode):
        asked.append((warmup, rep))
        return 1.0

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    _launch.bench_ms(lambda: None)
    with tuning.retuning():
        _launch.bench_ms(lambda: None)
    assert asked == [_launch.STEP_BENCH_MS, _launch.TUNE_BENCH_MS]
    assert _launch.STEP_BENCH_MS[1] < _launch.TUNE_BENCH_MS[1]


def test_retuning_times_each_key_once_a_block(monkeypatch, tmp_path):
    """``muon-offload tune`` (retuning): a key timed in the block is not timed again in it
    (the first step's compile pass times it, the step would again); a new block times it."""
    tuner = tuning_as_on_a_gpu(monkeypatch, tmp_path)
    monkeypatch.setattr(tuning, "TUNER", tuner)
    configs = [_launch.Config(block=256), _launch.Config(block=512)]
    timed = []

    def bench(config):
        timed.append(config)
        return float(config.block)

    dev = torch.device("cuda")
    tuner.choose("k", ("x",), configs, configs[0], dev, bench)  # decided, cached
    for _ in range(2):
        timed.clear()
        with tuning.retuning():
            for _ in range(2):
                assert tuner.choose("k", ("x",), configs, configs[0], dev, bench) == configs[0]
        assert timed == configs
