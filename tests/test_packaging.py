"""The package's metadata: one version, ``muon_offload.__version__``, which setuptools reads
without importing the package (the build environment has no torch) and which the installed
metadata carries."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import muon_offload

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_installed_metadata_version():
    assert muon_offload.__version__ == importlib.metadata.version("muon-offload")


def test_setuptools_reads_the_version_without_importing_the_package():
    setuptools = pytest.importorskip("setuptools")
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as in the build environment: importing fails\n"
        "from setuptools.config.expand import read_attr\n"
        "print(read_attr('muon_offload.__version__', {'muon_offload.kernels': 'kernels'}, '.'))\n"
        "assert 'muon_offload' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert proc.returncode == 0, f"setuptools {setuptools.__version__}: {proc.stderr[-2000:]}"
    assert proc.stdout.strip() == muon_offload.__version__

