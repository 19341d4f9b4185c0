"""Fused AdamW and Lion kernels against their torch references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _kernel_utils import DEVICES, INTERPRETED, assert_close, randn, tuning_as_on_a_gpu
from muon_offload.kernels import _launch
from muon_offload.kernels.elementwise import _adamw_kernel, adamw_, lion_
from muon_offload.kernels.elementwise_reference import adamw_reference_, lion_reference_

# 1 element, sizes that are no multiple of the tile (the interpreter's is 256, chunk 1024;
# the GPU's are 1024 to 4096), several chunks, mixed in one launch.
SIZES = [1, 7, 256, 1000, 2500]
F32, BF16 = torch.float32, torch.bfloat16
DTYPES = [(F32, F32, F32), (BF16, BF16, BF16), (F32, BF16, BF16), (BF16, F32, F32)]
ADAMW = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LION = dict(lr=3e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)


def _segments(sizes, dtype, device, positive=False):
    return [randn(n, dtype, device, positive=positive) for n in sizes]


def _clone(tensors):
    return [t.clone() for t in tensors]


def _one_sign(gs, ms, device):
    """g and m of one random sign per element, |.| >= 0.1: any lerp of them is >= 0.1 from
    zero, so its sign (Lion's update, a cautious mask) cannot flip on a rounding difference."""
    out_g, out_m = [], []
    for g, m in zip(gs, ms, strict=True):
        sign = torch.randn(g.numel(), device=device).sign()
        out_g.append((sign * (g.float().abs() + 0.1)).to(g.dtype))
        out_m.append((sign * (m.float().abs() + 0.1)).to(m.dtype))
    return out_g, out_m


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: "-".join(str(x)[6:] for x in d))
@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("cautious_wd", [False, True], ids=["wd", "cautious_wd"])
def test_adamw_matches_reference(device, dtypes, step, cautious_wd):
    p_dtype, g_dtype, s_dtype = dtypes
    p, g = _segments(SIZES, p_dtype, device), _segments(SIZES, g_dtype, device)
    m, v = _segments(SIZES, s_dtype, device), _segments(SIZES, s_dtype, device, positive=True)
    if cautious_wd:  # the mask's sign(m_new): away from zero, or fp32 rounding could flip it
        g, m = _one_sign(g, m, device)
    ref = [_clone(x) for x in (p, g, m, v)]
    adamw_(p, g, m, v, **ADAMW, step=step, cautious_wd=cautious_wd)
    adamw_reference_(*ref, **ADAMW, step=step, cautious_wd=cautious_wd)
    for actual, expected in zip((p, m, v), (ref[0], ref[2], ref[3]), strict=True):
        for a, e in zip(actual, expected, strict=True):
            assert_close(a, e, exact_bf16=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES[:3], ids=lambda d: "-".join(str(x)[6:] for x in d))
@pytest.mark.parametrize("cautious_wd", [False, True], ids=["wd", "cautious_wd"])
def test_lion_matches_reference(device, dtypes, cautious_wd):
    p_dtype, g_dtype, s_dtype = dtypes
    p = _segments(SIZES, p_dtype, device)
    # Lion's update is a sign: keep lerp(m, g) away from zero (m and g of one sign, |.| >= 0.1),
    # or a rounding difference could flip it.
    g, m = _one_sign(_segments(SIZES, g_dtype, device), _segments(SIZES, s_dtype, device), device)
    ref = [_clone(x) for x in (p, g, m)]
    lion_(p, g, m, **LION, cautious_wd=cautious_wd)
    lion_reference_(*ref, **LION, cautious_wd=cautious_wd)
    for actual, expected in zip((p, m), (ref[0], ref[2]), strict=True):
        for a, e in zip(actual, expected, strict=True):
            assert_close(a, e, exact_bf16=False)


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_on_unaligned_slices_leaves_neighbours(device):
    """Segments as views into flat buffers at odd offsets (no 16-byte alignment) beside
    aligned ones and another dtype (one launch per dtype and alignment); elements between
    the views stay as they were."""
    sizes, gap = [5, 300, 1], 3
    total = sum(sizes) + gap * (len(sizes) + 1)
    bufs = [randn(total, F32, device, positive=(j == 3)) for j in range(4)]
    before = [b.clone() for b in bufs]
    lists, off = [[], [], [], []], gap
    for n in sizes:
        for j in range(4):
            lists[j].append(bufs[j][off : off + n])
        off += n + gap
    # Separate allocations (16-byte aligned): one more fp32 segment, which goes in the aligned
    # launch beside the unaligned one, and a bf16 group of its own.
    for dtype, n in ((F32, 1500), (BF16, 33)):
        for j in range(4):
            lists[j].append(randn(n, dtype, device, positive=(j == 3)))
    ref = [_clone(x) for x in lists]
    adamw_(*lists, **ADAMW, step=5)
    adamw_reference_(*ref, **ADAMW, step=5)
    for j in (0, 2, 3):
        for a, e in zip(lists[j], ref[j], strict=True):
            assert_close(a, e, exact_bf16=False)
    untouched = torch.ones(total, dtype=torch.bool, device=device)
    off = gap
    for n in sizes:
        untouched[off : off + n] = False
        off += n + gap
    for b, b0 in zip(bufs, before, strict=True):
        assert torch.equal(b[untouched], b0[untouched])


def test_chunk_rows_int64():
    """Table rows for segments past 2^31 elements: starts and counts stay exact in int64."""
    numels = np.array([3, 5_000_000_000, 0, 1], dtype=np.int64)
    ptrs = np.arange(8, dtype=np.int64).reshape(4, 2) * 4096
    rows = _launch.chunk_rows(ptrs, numels, 1 << 20)
    assert rows.dtype == np.int64
    assert rows[:, 3].sum() == numels.sum()
    big = rows[rows[:, 0] == 2 * 4096]
    assert big[-1, 2] == (len(big) - 1) << 20 and big[-1, 2] > 2**32
    assert big[-1, 2] + big[-1, 3] == 5_000_000_000


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_int64_offset_probe(device):
    """A table row whose start is 2^33 + 16 elements past a base address 2^33 + 16 elements
    before the tensor: the kernel reaches the tensor only if it adds the start in int64."""
    n, shift = 40, (1 << 33) + 16
    p, g = randn(n, F32, device), randn(n, F32, device)
    m, v = randn(n, F32, device), randn(n, F32, device, positive=True)
    ref = [[t.clone()] for t in (p, g, m, v)]
    row = [t.data_ptr() - shift * 4 for t in (p, g, m, v)] + [shift, n]
    grads = torch.tensor([row[1]], dtype=torch.int64, device=device)  # the row holds its row
    row[1] = 0
    table = torch.tensor([row], dtype=torch.int64, device=device)
    step_scalars = (0.1, 0.95, 0.05, 1e-8, 1 - 3e-3 * 0.1, 3e-3 / (1 - 0.9), (1 - 0.95) ** 0.5)
    scalars = torch.tensor(step_scalars, dtype=F32, device=device)
    dtypes = (_launch.triton_dtype(F32),) * 4
    _adamw_kernel[(1,)](table, grads, scalars, *dtypes, BLOCK=256, ALIGNED=False, CAUTIOUS=False)
    adamw_reference_(*ref, **ADAMW, step=1)
    for a, e in zip((p, m, v), (ref[0][0], ref[2][0], ref[3][0]), strict=True):
        assert_close(a, e, exact_bf16=False)


@pytest.mark.cuda
def test_autotune_applies_update_once(tmp_path, monkeypatch):
    """A fresh tuning cache forces the tuner to time every config; the caller's tensors must
    still be updated exactly once (tuning runs on scratch copies). The decision is cached on
    disk, and new hyper-parameters reuse the compiled kernel."""
    from muon_offload.kernels import shipped_tables

    monkeypatch.setenv("MUON_OFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MUON_OFFLOAD_AUTOTUNE", "1")
    # No shipped table either: it would decide the key untimed (and write no cache).
    monkeypatch.setattr(shipped_tables, "SHIPPED_DIR", tmp_path / "no-tables")
    monkeypatch.setattr(_launch, "TUNER", _launch.Tuner())
    import muon_offload.kernels.elementwise as ew

    monkeypatch.setattr(ew, "TUNER", _launch.TUNER)
    sizes = [1, 70_001, 1 << 20]
    p, g, m = (_segments(sizes, F32, "cuda") for _ in range(3))
    v = _segments(sizes, F32, "cuda", positive=True)
    ref = [_clone(x) for x in (p, g, m, v)]
    adamw_(p, g, m, v, **ADAMW, step=1)
    adamw_reference_(*ref, **ADAMW, step=1)
    for a, e in zip(p + m + v, ref[0] + ref[2] + ref[3], strict=True):
        assert_close(a, e, exact_bf16=False)
    files = list(tmp_path.glob("tune-*.json"))
    assert len(files) == 1 and "adamw|" in files[0].read_text()
    compiled = _compiled_variants(_adamw_kernel)
    adamw_(p, g, m, v, **{**ADAMW, "lr": 1e-4}, step=2)
    assert _compiled_variants(_adamw_kernel) == compiled


def _compiled_variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in kernel.cache.values())


@pytest.mark.skipif(not INTERPRETED, reason="checks the Triton interpreter (no GPU)")
def test_interpreter_uses_single_config():
    from muon_offload.kernels.elementwise import INTERPRETER_CONFIG

    config = _launch.TUNER.choose(
        "adamw", ("x",), [], INTERPRETER_CONFIG, torch.device("cpu"), bench=None
    )
    assert config == INTERPRETER_CONFIG


def test_tuner_names_the_error_when_no_config_runs(monkeypatch, tmp_path):
    """Every config failing (e.g. a kernel that does not compile) must say why, not only that
    no config ran: the cause travels with the error."""
    tuner = tuning_as_on_a_gpu(monkeypatch, tmp_path)
    configs = [_launch.Config(block=256), _launch.Config(block=512)]

    def bench(config):
        raise ValueError(f"cannot compile at block {config.block}")

    with pytest.raises(RuntimeError, match="block=256.*ValueError: cannot compile") as info:
        tuner.choose("k", ("x",), configs, configs[0], torch.device("cuda"), bench)
    assert isinstance(info.value.__cause__, ValueError)


def test_tuner_records_the_configs_that_failed(monkeypatch, tmp_path):
    tuner = tuning_as_on_a_gpu(monkeypatch, tmp_path)
    configs = [_launch.Config(block=256), _launch.Config(block=512)]

    def bench(config):
        if config.block == 256:
            raise ValueError("out of shared memory")
        return 1.0

    chosen = tuner.choose("k", ("x",), configs, configs[0], torch.device("cuda"), bench)
    assert chosen == configs[1]
    assert tuner.last["k"]["failed"] == {"block=256 warps=4": "ValueError: out of shared memory"}
