"""bench/product_configs.py on a machine without a GPU: its shapes parse as the usage says, a
bad one is refused, and a run says it needs a GPU instead of failing inside a kernel."""

import argparse

import pytest
import torch
from _bench_import import import_bench

(product_configs,) = import_bench("product_configs")


def test_shapes_parse_and_bad_ones_are_refused():
    assert product_configs.parse_shape("128x1024x1024") == (128, 1024, 1024, False)
    assert product_configs.parse_shape("96x512x1024T") == (96, 512, 1024, True)
    for bad in ("3x4", "0x8x8", "axbxc", "8x8x8TT"):
        with pytest.raises(argparse.ArgumentTypeError):
            product_configs.parse_shape(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a GPU")
def test_without_a_gpu_it_says_so(capsys):
    assert product_configs.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
