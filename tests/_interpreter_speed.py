"""A faster, equivalent ``_patch_builtin`` for Triton's CPU interpreter, installed by conftest.

The interpreter calls ``_patch_builtin`` for triton.language, its tensor class, tl.math and
the descriptor base at every launch and again at every call of a ``@triton.jit`` helper from
a kernel, once per program of the grid; each call walks ``inspect.getmembers`` of the module
(a ``dir``, a ``getattr`` of every name, a sort) to find the builtins to wrap. That walk was
about a third of the suite's time under the interpreter. The builtins a module holds do not
change, so this finds their names once, before any launch (nothing wrapped yet), and each call
wraps those of them that are builtins at that moment, in the same order: the same attributes
wrapped the same way as the original's walk, without it. Anything else (another module, an
interpreter whose ``_patch_builtin`` is not that walk) goes to the original.
"""

from __future__ import annotations

import inspect


def cache_builtin_names() -> bool:
    """Install the cached ``_patch_builtin``; True if installed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None or getattr(original, "_names", None) is not None:
        return False
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return False
    if "inspect.getmembers(pkg)" not in source or "is_builtin(member)" not in source:
        return False
    is_builtin = tl.core.is_builtin
    pkgs = [tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)]
    names = {
        id(pkg): (pkg, [name for name, member in inspect.getmembers(pkg) if is_builtin(member)])
        for pkg in pkgs
        if pkg is not None
    }

    def patch_builtin(pkg, *rest):
        known = names.get(id(pkg))
        if known is None or known[0] is not pkg:
            return original(pkg, *rest)
        for name in known[1]:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, *rest)

    patch_builtin._names = names
    interpreter._patch_builtin = patch_builtin
    return True
