"""The package's layout promises: ``import muon_offload`` loads the optimizer and nothing of
the tools (bench, demo, tune, workloads, matplotlib), and no module grows past one job."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_loads_no_tools():
    code = (
        "import sys, muon_offload\n"
        "from muon_offload import Muon, AdamW, StepInterrupted\n"
        "bad = sorted(m for m in sys.modules if m.startswith('muon_offload.tools')"
        " or m.split('.')[0] in ('matplotlib', 'transformers', 'dion'))\n"
        "print(repr(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout


def _sources():
    for folder in ("muon_offload", "kernels", "bench"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_modules_and_classes_stay_small():
    # The bounds: no module over 400 lines, no class over 250.
    too_long = []
    for path in _sources():
        text = path.read_text()
        if text.count("\n") > 400:
            too_long.append((str(path.relative_to(ROOT)), text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno > 250:
                too_long.append(
                    (f"{path.relative_to(ROOT)}:{node.name}", node.end_lineno - node.lineno)
                )
    assert not too_long
