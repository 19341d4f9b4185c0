"""The compiled variants a step needs (tests/kernel_variant_count.py, Triton's own cache keys
for sm_90, the H200's decisions) follow from the matrices' shapes, never from how many of them
share a batch: a model with more layers compiles nothing more on its first step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("kernel_variant_count.py")


def test_a_moe_steps_variants_do_not_depend_on_its_layer_count():
    pytest.importorskip("triton.backends.nvidia", reason="needs triton's CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "moe", "1", "--", "moe", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads(line) for line in proc.stdout.strip().splitlines())
    assert one["untabled_keys"] == {}  # the shipped table decides every key: nothing timed
    assert one["launches"] == two["launches"]  # the same batches, twice the matrices each
    assert one["per_kernel"] == two["per_kernel"], (one, two)
    assert "_sym_gram_tma_kernel" in one["per_kernel"]  # the H200's path, not the CPU's
