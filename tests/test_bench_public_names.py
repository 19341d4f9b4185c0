"""The scripts in bench/ use the package as a user's script would: no private name of
muon_offload (``from muon_offload.x import _y``, ``muon_offload.x._y``, ``module._y``, or
``obj._y`` on an optimizer), so that renaming an internal never breaks them unseen."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "bench").glob("*.py"))
# Private attributes of other libraries' objects, each with where it comes from.
OTHERS = {
    "model.config._experts_implementation": "transformers' config of a MoE model",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_uses(source: str) -> list[str]:
    """Every use of a private name of muon_offload in ``source``, as written."""
    tree = ast.parse(source)
    outside = set()  # names bound to modules of other libraries (torch, os, ...)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "muon_offload":
                    if any(_private(p) for p in alias.name.split(".")):
                        found.append(f"import {alias.name}")
                else:
                    outside.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            ours = node.module.split(".")[0] == "muon_offload"
            for alias in node.names:
                if ours and (any(map(_private, node.module.split("."))) or _private(alias.name)):
                    found.append(f"from {node.module} import {alias.name}")
                elif not ours:
                    outside.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            text = _dotted(node)
            root = text.split(".")[0] if text else None
            if root in ("self", "cls") or root in outside or text in OTHERS:
                continue
            found.append(text or f"<expression>.{node.attr}")
    return found


def test_the_check_sees_each_kind_of_private_use():
    source = (
        "import torch\n"
        "from muon_offload.kernels import _launch\n"
        "from muon_offload.kernels.elementwise import _adamw_tile, adamw_\n"
        "import muon_offload.engine._x\n"
        "from muon_offload.engine import planner\n"
        "planner._interleave([])\n"
        "opt._graphs = None\n"
        "torch._foreach_add_([], [])\n"
        "self._x = 1\n"
    )
    assert sorted(private_uses(source)) == [
        "from muon_offload.kernels import _launch",
        "from muon_offload.kernels.elementwise import _adamw_tile",
        "import muon_offload.engine._x",
        "opt._graphs",
        "planner._interleave",
    ]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_scripts_use_no_private_name_of_the_package(script):
    assert private_uses(script.read_text()) == []
