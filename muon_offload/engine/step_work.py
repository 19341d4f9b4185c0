"""A step's (group index, parameter) pairs, checked and read in C-level passes
(``step_work``, ``StepWork``): before any parameter or state is touched, so a bad gradient
raises with the optimizer exactly as it was."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, is_, is_not, itemgetter

import torch
from torch import Tensor

from .group_checks import PARAM_DTYPES, check_grad, where
from .tensor_reads import Sweep


class StepWork(list):
    """``step_work``'s (group index, parameter) pairs, and what its checks read of them, one
    C-level pass each: the parameters, their gradients, shapes and dtypes, the gradients'
    dtypes. The plan's key and the graph's key (``graphs.step_key``) reuse these reads, made
    in the same step before anything is touched; ``read()`` makes them where the checks did
    not (DTensor parameters, a check that fails)."""

    plain = False  # every parameter and gradient a plain tensor (no DTensor): local(t) is t
    # Every parameter of every group, in group order, has a gradient: the pairs are all the
    # groups' parameters, and a step with the same parameters may reuse them (``step_work``).
    complete = False
    which: tuple | None = (
        None  # the plan key's part naming the pairs (``StepPlanner.plan``), once made
    )
    state_dicts: tuple[dict, ...] | None = None  # each parameter's state (``StateBuilder.ensure``)
    # The parameters' and gradients' data pointers and whether every gradient is contiguous,
    # read with the checks when the step computes a graph key (``step_work(pointers=True)``):
    # nothing between the checks and the key moves a parameter or a gradient.
    pointers: tuple[tuple[int, ...], tuple[int, ...], bool] | None = None
    # Positions of the parameters that are not contiguous (plain tensors only): the step
    # updates a contiguous copy of each and writes it back in place (``chunks.py``).
    copied: tuple[int, ...] = ()
    params: tuple[Tensor, ...]
    grads: tuple[Tensor, ...]
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    grad_dtypes: tuple[torch.dtype, ...]

    def read(self, grads: Sequence[Tensor] | None = None, params=None) -> StepWork:
        self.params = tuple(map(_second, self)) if params is None else params
        self.grads = tuple(map(_grad, self.params) if grads is None else grads)
        self.shapes = tuple(map(_shape, self.params))
        self.dtypes = tuple(map(_dtype, self.params))
        self.grad_dtypes = tuple(map(_dtype, self.grads))
        return self

    def pairs_only(self) -> StepWork:
        """The pairs and their parameters, for a later step to reuse (``step_work``): none of
        this step's reads, so that no gradient is kept alive past its step."""
        kept = StepWork(self)
        kept.params, kept.complete, kept.which = self.params, self.complete, self.which
        return kept


def step_work(
    param_groups: list[dict], last: StepWork | None = None, pointers: bool = False
) -> tuple[StepWork, torch.device | None]:
    """The (group index, parameter) pairs that have a gradient this step, checked, and the
    one device they are on (None when no parameter has a gradient). ``last``: an earlier
    step's pairs (``StepWork.pairs_only``), reused when every parameter has a gradient and the
    groups hold the very same parameters (one C-level pass of ``is``): the pairs are then
    equal, and the later lookups keyed on them (the plan's, the state's) compare one object
    instead of thousands. ``pointers``: read the graph key's data pointers too
    (``StepWork.pointers``), with the same tensors still in the CPU's caches."""
    params = tuple(chain.from_iterable(map(_params_of, param_groups)))
    grads = tuple(map(_grad, params))
    if _NONE_TYPE in set(map(type, grads)):  # some parameters have no gradient: leave them
        has_grad = tuple(map(is_not, grads, repeat(None)))
        work = StepWork(compress(_pairs(param_groups), has_grad))
        grads, params = tuple(compress(grads, has_grad)), None
    elif last is not None and last.complete and same_objects(params, last.params):
        work, params = StepWork(last), last.params
        work.complete, work.which = True, last.which
    else:
        work = StepWork(_pairs(param_groups))
        work.complete = True
    if not work:
        return work.read(grads, params), None
    device = _checked_at_once(work, grads, params, pointers)
    if device is not None:
        return work, device
    devices, copied = set(), []
    for k, (gi, p) in enumerate(work):
        check_grad(p, gi)
        local_param = getattr(p, "_local_tensor", p)
        if local_param.dtype not in PARAM_DTYPES:  # changed since construction
            raise ValueError(
                f"{where(gi, p)}: {p.dtype} parameters are not supported; expected one "
                f"of {PARAM_DTYPES}"
            )
        if not local_param.is_contiguous():
            if local_param is not p:  # a DTensor's shard: FSDP2's are contiguous
                raise ValueError(f"{where(gi, p)}: a DTensor's local tensor must be contiguous")
            copied.append(k)
        devices.add(local_param.device)
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    work.copied = tuple(copied)
    return work, devices.pop()


def _pairs(param_groups: list[dict]):
    """(group index, parameter) of every parameter, in group order."""
    return chain.from_iterable(zip(repeat(gi), g["params"]) for gi, g in enumerate(param_groups))


def same_objects(a: Sequence, b: Sequence) -> bool:
    """The same objects in the same order (``is``, never a tensor's ``==``)."""
    return len(a) == len(b) and all(map(is_, a, b))


_grad, _dtype, _shape = attrgetter("grad"), attrgetter("dtype"), attrgetter("shape")
_second, _params_of = itemgetter(1), itemgetter("params")
_NONE_TYPE = type(None)
_PLAIN_TYPES = frozenset((Tensor, torch.nn.Parameter))
_PARAM_DTYPE_SET = frozenset(PARAM_DTYPES)


def _checked_at_once(
    work: StepWork, grads: Sequence[Tensor], params=None, pointers: bool = False
) -> torch.device | None:
    """``step_work``'s checks for all parameters at once, C-level passes (a per-parameter loop
    of Python costs milliseconds a step on a large model): the one device when every check
    passes, None when one may fail or a parameter or gradient is not a plain tensor (DTensor),
    and then the per-parameter checks run and raise the precise error. What it reads is kept
    in ``work`` (``StepWork.read``, ``Sweep``)."""
    params = tuple(map(_second, work)) if params is None else params
    grads = tuple(grads)
    if not _PLAIN_TYPES.issuperset(map(type, params)) or not _PLAIN_TYPES.issuperset(
        map(type, grads)
    ):
        work.read(grads, params)
        return None
    sweep = Sweep(params, grads, pointers)
    work.params, work.grads, work.plain = params, grads, True
    work.shapes, work.dtypes, work.grad_dtypes = sweep.shapes, sweep.dtypes, sweep.grad_dtypes
    work.pointers = sweep.pointers
    if (
        sweep.layouts != {torch.strided}  # sparse gradients
        # Floating (never complex) gradients; parameters of a dtype the kernels serve.
        or not all(d.is_floating_point for d in set(work.grad_dtypes))
        or not _PARAM_DTYPE_SET.issuperset(work.dtypes)
        or not sweep.same_shapes
        or len(sweep.devices) != 1
        or not sweep.contiguous
    ):
        return None
    return sweep.devices.pop()
