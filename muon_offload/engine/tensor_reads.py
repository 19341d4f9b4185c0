"""Reading what the step's checks and its graph key need of thousands of tensors: C-level
passes (``map`` with C callables), a block of tensors at a time.

Each pass touches a few cache lines a tensor (its Python object, its TensorImpl, for a data
pointer its storage). A block's lines stay in the CPU's L2 cache from one pass to the next,
where passes over all of a large model's tensors would fetch them again each time: 10% of
these reads (qwen3, 2474 parameters and as many gradients, a CPU with 512 KiB of L2 a core).
"""

from __future__ import annotations

from operator import attrgetter, eq

from torch import Tensor

BLOCK = 256  # tensors a block: 2 x 256 x a few 64-byte lines, well inside an L2 cache

_dtype, _shape = attrgetter("dtype"), attrgetter("shape")
_layout, _device = attrgetter("layout"), attrgetter("device")


class Sweep:
    """What the checks read of plain tensors (no DTensor), a block of parameters and then
    their gradients at a time: the parameters' shapes and dtypes, the gradients' dtypes (as
    tuples, one entry a parameter); the gradients' layouts and all devices (as sets); whether
    every gradient's shape is its parameter's and every parameter is contiguous.
    ``pointers``: also the parameters' and gradients' data pointers and whether every
    gradient is contiguous, for the graph's key (None where a tensor has no storage)."""

    def __init__(self, params: tuple[Tensor, ...], grads: tuple[Tensor, ...], pointers: bool):
        self._shapes, self._dtypes, self._grad_dtypes = [], [], []
        self.layouts, self.devices = set(), set()
        self.same_shapes = self.contiguous = True
        self._pointers = ([], [], True) if pointers else None
        for i in range(0, len(params), BLOCK):
            self._add(params[i : i + BLOCK], grads[i : i + BLOCK])
        self.shapes, self.dtypes = tuple(self._shapes), tuple(self._dtypes)
        self.grad_dtypes = tuple(self._grad_dtypes)
        self.pointers = None
        if self._pointers is not None:
            param_ptrs, grad_ptrs, contiguous = self._pointers
            self.pointers = (tuple(param_ptrs), tuple(grad_ptrs), contiguous)

    def _add(self, params: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> None:
        shapes = tuple(map(_shape, params))
        self._shapes.extend(shapes)
        self._dtypes.extend(map(_dtype, params))
        self.devices.update(map(_device, params))
        self.contiguous = all(map(Tensor.is_contiguous, params)) and self.contiguous
        self._grad_dtypes.extend(map(_dtype, grads))
        self.layouts.update(map(_layout, grads))
        self.same_shapes = all(map(eq, map(_shape, grads), shapes)) and self.same_shapes
        self.devices.update(map(_device, grads))
        if self._pointers is not None:
            self._add_pointers(params, grads)

    def _add_pointers(self, params: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> None:
        param_ptrs, grad_ptrs, contiguous = self._pointers
        try:
            param_ptrs.extend(map(Tensor.data_ptr, params))
            grad_ptrs.extend(map(Tensor.data_ptr, grads))
        except RuntimeError:  # no storage (a sparse tensor): the checks refuse it
            self._pointers = None
            return
        contiguous = all(map(Tensor.is_contiguous, grads)) and contiguous
        self._pointers = (param_ptrs, grad_ptrs, contiguous)
