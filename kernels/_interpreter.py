"""A fix for triton 3.6's CPU interpreter under numpy >= 2.3, applied when the kernels are
imported with ``TRITON_INTERPRET=1``.

triton 3.6's interpreter turns a scalar that a kernel computed at run time (a loaded count, a
bound derived from ``tl.program_id``) into a Python int with ``int(array)`` on a 1-element
array, which numpy >= 2.3 refuses ("only 0-dimensional arrays can be converted to Python
scalars"): every kernel whose loop count is such a scalar fails. triton 3.9 squeezes the array
first; this does the same where the installed interpreter does not. Compiled kernels never take
this path, and nothing changes for interpreters that already squeeze.
"""

from __future__ import annotations

import inspect


def squeeze_interpreter_scalars() -> bool:
    """Patch the interpreter's ``__index__`` of tensors to squeeze first; True if patched."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # a triton without the interpreter module: nothing to fix
        return False
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_muon_offload_squeezes", False):
        return False
    try:
        if "squeeze" in inspect.getsource(patch):
            return False
    except (OSError, TypeError):  # no source to read: patching twice is still correct
        pass

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._muon_offload_squeezes = True
    interpreter._patch_lang_tensor = patched
    return True
