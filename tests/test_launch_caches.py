"""What a launcher keeps between launches from its arguments' metadata (candidate configs, TMA
descriptors' validated fields, launch plans) gives what computing it again gives, follows the
metadata it depends on, and keeps every error of bad input."""

import dataclasses

import pytest
import torch
from muon_offload.kernels import _tma, shape_classes
from muon_offload.kernels.gram import GRAM_CONFIGS
from muon_offload.kernels.poly_apply import POLY_APPLY_CONFIGS

descriptor = pytest.importorskip("triton.tools.tensor_descriptor")


@pytest.mark.parametrize(("rows", "cols"), [(64, None), (384, None), (2048, None), (128, 4096)])
def test_fitting_kept_equals_computed(rows, cols):
    for configs in (GRAM_CONFIGS, POLY_APPLY_CONFIGS):
        first = shape_classes.fitting(configs, rows, cols)
        again = shape_classes.fitting(configs, rows, cols)
        assert again == first == shape_classes._fitting(configs, rows, cols or rows)
        # A list (which may change) is never answered from what was kept for a tuple.
        assert shape_classes.fitting(list(configs[:1]), rows, cols) == configs[:1]


def _fields(d):
    return {f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name != "base"}


@pytest.mark.parametrize("transposed", [False, True])
def test_descriptor_from_kept_fields_equals_a_new_one(transposed):
    _tma._DESCRIPTORS.clear()
    block = (64, 32)
    for step in range(3):  # a new tensor each time, of one layout: the kept fields, its base
        t = torch.randn(2, 128, 96, dtype=torch.bfloat16)
        t = t.mT.contiguous().mT if transposed else t
        assert _tma.tma_layout(t) is transposed
        made = _tma.tensor_descriptor(t, transposed, block)
        fresh = descriptor.TensorDescriptor.from_tensor(t.mT if transposed else t, [1, *block])
        assert type(made) is type(fresh)
        assert _fields(made) == _fields(fresh)
        assert made.base.data_ptr() == t.data_ptr()
        assert made.base.shape == fresh.base.shape and made.base.stride() == fresh.base.stride()
        assert len(_tma._DESCRIPTORS) == 1, step


def test_descriptor_of_a_misaligned_base_still_raises():
    _tma._DESCRIPTORS.clear()
    flat = torch.randn(2 * 64 * 64 + 8, dtype=torch.bfloat16)
    good = flat[:-8].view(2, 64, 64)
    _tma.tensor_descriptor(good, False, (64, 64))
    shifted = flat[1:-7].view(2, 64, 64)  # same shape and strides, base 2 bytes off
    with pytest.raises(AssertionError, match="16-byte aligned"):
        _tma.tensor_descriptor(shifted, False, (64, 64))


class _Recorder:
    """A kernel stand-in: records each launch's grid, arguments and keywords."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def _described(args):
    """Launch arguments by value: a descriptor's fields and base layout, a tensor's layout."""

    def value(a):
        if isinstance(a, descriptor.TensorDescriptor):
            return _fields(a), value(a.base)
        if isinstance(a, torch.Tensor):
            return a.shape, a.stride(), a.dtype
        return a

    return [value(a) for a in args]


@pytest.mark.parametrize("transposed", [False, True])
def test_tma_launch_plan_gives_a_fresh_launch(monkeypatch, transposed):
    """A TMA product launch from a kept plan passes what a launch planned anew passes, for
    new tensors of one layout and after the layout or the batch changes."""
    from muon_offload.kernels import gram_tma, poly_apply_tma
    from muon_offload.kernels.poly_apply_tma import apply_kernel_args

    gram_config = next(c for c in GRAM_CONFIGS if c.tma)
    poly_config = next(c for c in POLY_APPLY_CONFIGS if c.tma)
    runs = []
    for kept in (True, False):
        recorder = _Recorder()
        monkeypatch.setattr(gram_tma, "_sym_gram_tma_kernel", recorder)
        monkeypatch.setattr(poly_apply_tma, "_poly_apply_tma_kernel", recorder)
        for batch in (3, 3, 5):
            if not kept:
                gram_tma._PLANS.clear()
                poly_apply_tma._PLANS.clear()
            x = torch.randn(batch, 128, 192, dtype=torch.bfloat16)
            x = x.mT.contiguous().mT if transposed else x
            gram = torch.empty(batch, 128, 128, dtype=torch.bfloat16)
            gram_tma._launch_tma(x, x, None, gram, 1.0, 0.0, 0.0, False, gram_config, None)
            out = torch.empty_like(x)
            apply = apply_kernel_args(None, None, x)
            poly_apply_tma._launch_tma(gram, x, out, 1.5, poly_config, None, apply)
        runs.append([(g, _described(a), k) for g, a, k in recorder.launches])
    assert runs[0] == runs[1]


def test_alignment_is_every_address_a_multiple_of_16_bytes():
    from muon_offload.kernels._launch import aligned_addresses, all_aligned

    base = torch.zeros(64)  # fp32: 4 bytes an element
    assert all_aligned(([base, base[4:]], [base[8:]]))
    assert not all_aligned(([base, base[4:]], [base[8:], base[1:]]))
    assert aligned_addresses([0, 16, 4096], iter([32])) and not aligned_addresses([16], [8])
    assert aligned_addresses()
