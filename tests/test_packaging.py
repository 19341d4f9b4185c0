"""The package's metadata and what it ships: one version, ``muon_offload.__version__``, which
setuptools reads without importing the package (the build environment has no torch) and which
the installed metadata carries; an sdist with the package and its docs but no tests, benchmark
scripts or figure data, from which a wheel builds."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
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


# What a source tree holds; the sdist is built from a copy of it (setuptools writes into the tree).
SOURCE = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "muon_offload", "kernels")
SOURCE_FOLDERS_LEFT_OUT = ("tests", "bench", "docs/figures")


def _build(hook: str, source: Path, out: Path) -> Path:
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=source, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out / proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"pyproject.toml needs setuptools>=77, not {setuptools.__version__}")
    source = tmp_path_factory.mktemp("source")
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in (*SOURCE, "tests", "bench", "docs"):
        if not (ROOT / name).exists():
            continue
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=skip)
        else:
            shutil.copy2(ROOT / name, source / name)
    archive = _build("build_sdist", source, tmp_path_factory.mktemp("dist"))
    unpacked = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    (top,) = unpacked.iterdir()
    return source, top


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_sdist_holds_the_package_and_its_docs_and_no_tests(sdist):
    source, top = sdist
    shipped = _files(top)
    assert top.name == f"muon_offload-{muon_offload.__version__}"
    modules = {f for f in _files(source) if f.startswith(("muon_offload/", "kernels/"))}
    assert modules and modules <= shipped
    docs = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert docs and docs <= shipped  # the README's links resolve in the unpacked sdist
    assert {"README.md", "LICENSE", "pyproject.toml", "PKG-INFO"} <= shipped
    left_out = [f for f in shipped if f.startswith(tuple(f"{d}/" for d in SOURCE_FOLDERS_LEFT_OUT))]
    assert not left_out


def test_sdist_metadata(sdist):
    _, top = sdist
    info = (top / "PKG-INFO").read_text().split("\n\n", 1)[0].splitlines()
    assert f"Version: {muon_offload.__version__}" in info
    assert not [line for line in info if line.startswith(("Project-URL", "Home-page"))]
    assert any(line.startswith("Classifier: ") for line in info)
    assert any(line.startswith("Keywords: ") for line in info)
    assert {"Provides-Extra: peers", "Provides-Extra: dev", "Provides-Extra: hf"} <= set(info)


def test_a_wheel_builds_from_the_sdist(sdist, tmp_path):
    _, top = sdist
    wheel = _build("build_wheel", top, tmp_path)
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    kernels = {f"muon_offload/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.py")}
    assert kernels <= names and "muon_offload/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/"))]


@pytest.mark.parametrize("pypi", [False, True], ids=["alone", "pypi-kernels-installed"])
def test_the_kernels_folder_as_a_top_level_kernels_is_pypis_package_or_an_error(tmp_path, pypi):
    # From the checkout's root, 'import kernels' finds the folder before PyPI's package of that
    # name (which transformers imports, and whose setuptools plugin a build from the root
    # loads): PyPI's package where it is installed (here a stand-in on PYTHONPATH; python -S
    # leaves out the site-packages of this machine), else a clear error, not a half-imported
    # module.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pypi:
        package = tmp_path / "site" / "kernels"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("WHO = 'pypi'\n")
        (package / "locking.py").write_text("X = 1\n")
        env["PYTHONPATH"] = str(tmp_path / "site")
    code = "import kernels, kernels.locking; print(kernels.WHO, kernels.locking.X)"
    done = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if pypi:
        assert done.returncode == 0 and done.stdout.split() == ["pypi", "1"], done.stderr
    else:
        assert done.returncode != 0
        assert "ImportError" in done.stderr and "muon_offload.kernels" in done.stderr
