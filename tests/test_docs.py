"""The Python blocks of docs/usage.md run as written (on the CPU here): a block that starts
with a ``# torchrun`` line runs under torchrun with two gloo processes, the others one after
another in one interpreter, a block that starts with ``# (continues`` is a fragment of the one
before and is left out, a block that imports dion or transformers runs only where that package
is installed. And the docs' links hold: every relative link (and the README's into this
repository) reaches a file and a heading, and every file under docs/figures is shown by some
doc."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USAGE = ROOT / "docs" / "usage.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", USAGE.read_text(), flags=re.S | re.M)
RUNNABLE = [b for b in BLOCKS if not b.startswith("# (continues")]
# Blocks that use an optional package run only where it is installed.
OPTIONAL = {
    "dion": 'pip install "git+https://github.com/microsoft/dion@0a059a4" (not on PyPI)',
    "transformers": 'pip install -e ".[hf]"',
}


GLOO_TEARDOWN_ABORT = "terminate called without an active exception"
TORCHRUN = [b for b in RUNNABLE if b.startswith("# torchrun")]


def _optional_package(code: str) -> str | None:
    for package in OPTIONAL:
        if re.search(rf"^(import|from) {package}\b", code, flags=re.M):
            return package
    return None


# The single-process blocks by the optional package they use (None: none). Each set runs in
# one interpreter, a block in fresh globals and a folder of its own: a name a block does not
# import still fails it, and torch's import (seconds) is paid once a set, not once a block.
SETS = {
    package: [b for b in RUNNABLE if b not in TORCHRUN and _optional_package(b) == package]
    for package in (None, *OPTIONAL)
}
RUN_BLOCKS = """
import json, os, runpy, sys, traceback
failed = {}
for path in sys.argv[2:]:
    os.chdir(os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        failed[os.path.basename(os.path.dirname(path))] = traceback.format_exc()
with open(sys.argv[1], "w") as f:
    json.dump(failed, f)
"""


def _env():
    path = os.environ.get("PYTHONPATH", "")
    # The CPU path of offload=True, also on a machine with GPUs (see test_multi_gpu_bench).
    return dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")


def test_the_blocks_are_found():
    assert len(BLOCKS) >= 5 and len(RUNNABLE) == len(BLOCKS) - 1
    assert sum(len(s) for s in SETS.values()) + len(TORCHRUN) == len(RUNNABLE)
    assert all(SETS.values()) and TORCHRUN


@pytest.mark.parametrize("package", list(SETS), ids=["plain", *OPTIONAL])
def test_usage_blocks_run(package, tmp_path):
    if package and not importlib.util.find_spec(package):
        pytest.skip(f"needs {package}: {OPTIONAL[package]}")
    scripts = []
    for code in SETS[package]:
        folder = tmp_path / f"block{RUNNABLE.index(code)}"
        folder.mkdir()
        scripts.append(folder / "block.py")
        scripts[-1].write_text(code)
    result = tmp_path / "failed.json"
    cmd = [sys.executable, "-c", RUN_BLOCKS, str(result), *map(str, scripts)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path
    )
    assert proc.returncode == 0 and result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = json.loads(result.read_text())
    assert not failed, "\n".join(f"{name}:\n{trace}" for name, trace in failed.items())


@pytest.mark.distributed
@pytest.mark.parametrize("code", TORCHRUN, ids=[f"block{RUNNABLE.index(b)}" for b in TORCHRUN])
def test_torchrun_block_runs(code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", "2", str(script)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path
    )
    if proc.returncode != 0 and GLOO_TEARDOWN_ABORT in proc.stderr:
        # Seen once in six runs of the FSDP2 block, on 2 overloaded CPU cores (2026-12-01), not
        # reproduced alone: gloo's worker threads can abort the process at shutdown (pytorch
        # PR 179291). One rerun; a second abort, or any other failure, fails the test.
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# Links between the docs: relative ones, and the README's into this repository on GitHub.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPO_URL = "https://github.com/muon-offload/muon-offload/blob/main/"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _outside_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(text: str) -> Iterator[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but - and _
    dropped, spaces as dashes, a repeat numbered."""
    seen: dict[str, int] = {}
    for title in re.findall(r"^#+ +(.+?) *$", _outside_code(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def _doc_links():
    for doc in DOCS:
        for target in LINK.findall(_outside_code(doc.read_text())):
            if target.startswith(REPO_URL):
                yield doc, ROOT, target[len(REPO_URL) :]
            elif not re.match(r"^[a-z]+:", target):
                yield doc, doc.parent, target


def test_links_between_the_docs_resolve():
    broken = []
    for doc, base, target in _doc_links():
        path, _, anchor = target.partition("#")
        page = (base / path) if path else doc
        if not page.exists():
            broken.append(f"{doc.name}: {target} (no such file)")
        elif anchor and page.suffix == ".md" and anchor not in set(_anchors(page.read_text())):
            broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_figure_is_shown_by_a_doc():
    cited = {
        (base / target.partition("#")[0]).resolve()
        for _, base, target in _doc_links()
        if "figures/" in target
    }
    figures = {p.resolve() for p in (ROOT / "docs" / "figures").iterdir()}
    assert sorted(p.name for p in figures - cited) == []
