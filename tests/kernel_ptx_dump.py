"""Write the PTX of every kernel variant that tests/kernel_compile_check.py compiles, one file
a variant, and compare two such folders: how a change that must not change the generated code
(a shared ``@triton.jit`` helper, a host-side refactor) is checked on a machine without a GPU.

    python tests/kernel_ptx_dump.py DIR             # DIR/<kernel>__<hash>.ptx
    python tests/kernel_ptx_dump.py --compare A B   # exit 1 unless every variant is the same

A variant's file name hashes its signature, constexprs and launch options, so the same launch
names the same file before and after. Compilation stops at PTX (no ptxas: minutes less, and
ptxas's output follows from the PTX), in a Triton cache of its own. The comparison drops line
info only: ``.loc`` and ``.file`` lines, the ``$L__tmp`` labels that bound inlined scopes,
and the debug sections, all of which move with the source lines, not with the code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile


def _lines(path: str) -> list[str]:
    """A PTX file without its line info."""
    kept, in_debug = [], False
    with open(path) as f:
        for line in f:
            s = line.strip()
            if s.startswith(".section") and "debug" in s:
                in_debug = True
            if in_debug:
                in_debug = s != "}"
                continue
            if s.startswith((".loc", ".file")) or re.fullmatch(r"\$L__tmp\d+:", s):
                continue
            kept.append(line)
    return kept


def compare(before: str, after: str) -> int:
    names_a = {f for f in os.listdir(before) if f.endswith(".ptx")}
    names_b = {f for f in os.listdir(after) if f.endswith(".ptx")}
    both = sorted(names_a & names_b)
    differ = [f for f in both if _lines(os.path.join(before, f)) != _lines(os.path.join(after, f))]
    print(f"{len(names_a)} variants before, {len(names_b)} after, {len(both)} in both")
    for name in sorted(names_a ^ names_b):
        print(f"  only {'before' if name in names_a else 'after'}: {name}")
    for name in differ:
        print(f"  differs: {name}")
    print(f"{len(both) - len(differ)}/{len(both)} identical without line info")
    return 1 if differ or names_a != names_b else 0


_OUTDIR = ""


def _write_ptx(index: int) -> str:
    """The check's ``_compile`` for variant ``index``, writing its PTX (module level: the
    check's process pool sends it by name)."""
    import kernel_compile_check as check
    import triton
    from triton.compiler import ASTSource

    fn, signature, constexprs, options = check._VARIANTS[index]
    key = json.dumps(
        [
            sorted(signature.items()),
            sorted((k, check._freeze(v)) for k, v in constexprs.items()),
            sorted(options.items()),
        ]
    )
    name = f"{fn.__name__}__{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    try:
        src = ASTSource(fn, signature, constexprs)
        ptx = triton.compile(src, target=check.TARGET, options=options).asm["ptx"]
    except Exception as err:  # reported by the check's loop, as its own compile errors
        return f"{name}: {str(err)[-1500:]}"
    with open(os.path.join(_OUTDIR, name + ".ptx"), "w") as f:
        f.write(ptx)
    return ""


def dump(outdir: str) -> int:
    global _OUTDIR
    os.environ.pop("TRITON_INTERPRET", None)  # the check sets it itself, after its imports
    # A cache of its own: the entries it writes hold no cubin, and Triton's key does not
    # say so, so they must never answer a real compile.
    os.environ["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "kernel-ptx-cache")
    import kernel_compile_check as check
    from triton.backends.nvidia.compiler import CUDABackend

    add_stages = CUDABackend.add_stages

    def to_ptx(self, stages, options, language=None):
        add_stages(self, stages, options, language)
        stages["cubin"] = lambda src, metadata: b""  # stop at PTX

    CUDABackend.add_stages = to_ptx
    _OUTDIR = outdir
    os.makedirs(outdir, exist_ok=True)
    check._compile = _write_ptx  # the check's pool maps this name over its variants
    return check.main()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(dump(sys.argv.pop(1)))
