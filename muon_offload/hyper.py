"""Reading and checking param groups: everything here runs before any parameter or state
is touched, so a bad input raises with the optimizer exactly as it was."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain, compress, repeat
from operator import attrgetter, is_, is_not, itemgetter

import torch
from torch import Tensor

from .muon_shapes import read_num_heads
from .tensor_reads import Sweep

ALGORITHMS = ("muon", "adamw", "lion")
ADJUST_LR_MODES = ("spectral_norm", "rms_norm", None)


@dataclass(frozen=True)
class Hyper:
    """One group's hyper-parameters for one step, as plain Python numbers."""

    algorithm: str
    lr: float
    weight_decay: float
    mu: float = 0.0
    beta1: float = 0.0
    beta2: float = 0.0
    eps: float = 0.0
    nesterov: bool = False
    adjust_lr: str | None = None
    flatten: bool = False
    split_sizes: tuple[int, ...] | None = None
    num_heads: int | None = None  # dion's per-head split of 2-D weights (muon_shapes.py)
    # dion's cautious weight decay: decay only where the update and the parameter agree in sign
    cautious_wd: bool = False


def _where(group_index: int | None, param: Tensor | None = None) -> str:
    """Where a bad value is: a param group (a parameter of it), or the constructor's arguments
    (``None``: the defaults, checked before any group is made)."""
    if group_index is None:
        return "constructor"
    if param is None:
        return f"param group {group_index}"
    return f"param group {group_index} (parameter of shape {tuple(param.shape)})"


def _number(group: dict, key: str, group_index: int) -> float:
    value = group[key]
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.device.type != "cpu":
            # Reading a device tensor would sync the host with the GPU on every step.
            raise ValueError(
                f"{_where(group_index)}: {key} must be a number or a one-element CPU tensor, "
                f"got a tensor of shape {tuple(value.shape)} on {value.device}"
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_where(group_index)}: {key} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{_where(group_index)}: {key} must be finite and >= 0, got {value}")
    return value


def _beta(value, name: str, group_index: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_where(group_index)}: {name} must be a number, got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{_where(group_index)}: {name} must be in [0, 1), got {value}")
    return float(value)


def torch_betas(betas) -> tuple[float, float]:
    """torch's AdamW takes ``betas`` as two numbers or two one-element tensors, which it keeps
    as numbers: so does ours, refusing what torch refuses with a ValueError."""
    if isinstance(betas, Tensor) and betas.ndim == 1:
        betas = tuple(betas)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    tensors = [isinstance(b, Tensor) for b in betas]
    if any(tensors) and not all(tensors):
        raise ValueError(f"betas must be both numbers or both tensors, got {betas!r}")
    for i, b in enumerate(betas):
        if isinstance(b, Tensor) and b.numel() != 1:
            raise ValueError(f"betas[{i}] as a tensor must have one element, got {b!r}")
    return tuple(b.item() if isinstance(b, Tensor) else b for b in betas)


def check_beta(value, name: str) -> float:
    """A beta given to a constructor, before any group exists."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def read_hyper(group: dict, group_index: int) -> Hyper:
    """Validate one group's settings and its parameters' shapes; return its Hyper."""
    algorithm = group.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"{_where(group_index)}: unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}"
        )
    lr = _number(group, "lr", group_index)
    weight_decay = _number(group, "weight_decay", group_index)
    cautious_wd = bool(group.get("cautious_wd", False))
    if algorithm == "muon":
        adjust_lr = group.get("adjust_lr")
        if adjust_lr not in ADJUST_LR_MODES:
            raise ValueError(
                f"{_where(group_index)}: unknown adjust_lr {adjust_lr!r}; "
                f"expected one of {ADJUST_LR_MODES}"
            )
        for p in group["params"]:
            if p.ndim < 2:
                raise ValueError(
                    f"{_where(group_index, p)}: a muon group needs matrices (2 or more dims); "
                    "put vectors and scalars in an adamw or lion group"
                )
        num_heads = read_num_heads(group, partial(_where, group_index))
        split_sizes = _split_sizes(group, group_index)
        return Hyper(
            algorithm="muon",
            lr=lr,
            weight_decay=weight_decay,
            mu=_number(group, "mu", group_index),
            eps=_number(group, "epsilon", group_index),
            nesterov=bool(group["nesterov"]),
            adjust_lr=adjust_lr,
            flatten=bool(group["flatten"]),
            split_sizes=split_sizes,
            cautious_wd=cautious_wd,
            num_heads=num_heads,
        )
    beta1 = _beta(group["beta1"], "beta1", group_index)
    beta2 = _beta(group["beta2"], "beta2", group_index)
    if algorithm == "adamw":
        return Hyper(
            "adamw",
            lr,
            weight_decay,
            beta1=beta1,
            beta2=beta2,
            eps=_number(group, "epsilon", group_index),
            cautious_wd=cautious_wd,
        )
    return Hyper("lion", lr, weight_decay, beta1=beta1, beta2=beta2, cautious_wd=cautious_wd)


def _split_sizes(group: dict, group_index: int) -> tuple[int, ...] | None:
    split_sizes = group.get("split_sizes")
    if split_sizes is None:
        return None
    if (
        not isinstance(split_sizes, (tuple, list))
        or len(split_sizes) < 2
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in split_sizes)
    ):
        raise ValueError(
            f"{_where(group_index)}: split_sizes must be 2 or more positive ints, "
            f"got {split_sizes!r}"
        )
    if group.get("flatten"):
        raise ValueError(f"{_where(group_index)}: split_sizes is incompatible with flatten=True")
    for p in group["params"]:
        if p.ndim != 2 or p.shape[0] != sum(split_sizes):
            raise ValueError(
                f"{_where(group_index, p)}: split_sizes {tuple(split_sizes)} must sum to dim 0 "
                "of a 2-D parameter"
            )
    return tuple(split_sizes)


def check_grad(param: Tensor, group_index: int) -> None:
    """Raise if ``param.grad`` cannot be used; None grads are the caller's to skip.
    Dtype and layout are read on the local tensors: on a DTensor each such method call would
    go through DTensor's dispatch, thousands of times a step."""
    grad = param.grad
    local_param = getattr(param, "_local_tensor", param)
    local_grad = getattr(grad, "_local_tensor", grad)
    if grad.is_sparse or local_grad.layout != torch.strided:
        raise TypeError(f"{_where(group_index, param)}: sparse gradients are not supported")
    if local_grad.is_complex() or local_param.is_complex():
        raise TypeError(f"{_where(group_index, param)}: complex tensors are not supported")
    if not local_grad.is_floating_point() or not local_param.is_floating_point():
        raise TypeError(
            f"{_where(group_index, param)}: parameter and gradient must be floating point, "
            f"got {param.dtype} and {grad.dtype}"
        )
    if grad.shape != param.shape:
        raise ValueError(
            f"{_where(group_index, param)}: gradient shape {tuple(grad.shape)} differs from "
            "the parameter's"
        )
    if local_grad.device != local_param.device:
        raise ValueError(
            f"{_where(group_index, param)}: gradient is on {local_grad.device}, parameter on "
            f"{local_param.device}"
        )


def listed_params(params) -> list:
    """A group's ``params`` as ``torch.optim.Optimizer.add_param_group`` lists them (one
    tensor, or any iterable read once; a set is left for torch to refuse: its order is not
    fixed)."""
    if isinstance(params, Tensor):
        return [params]
    return params if isinstance(params, set) else list(params)


def check_unique_params(params: Sequence, param_groups: Sequence[dict], group_index: int):
    """A parameter listed twice would be stepped twice a step: refuse it in one group (torch
    only warns) and across groups (as torch does). ``(name, tensor)`` pairs are torch's named
    parameters."""
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    owner = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    seen = set()
    for p in tensors:
        if id(p) in seen:
            raise ValueError(f"{_where(group_index, p)} is listed twice in the group")
        if id(p) in owner:
            raise ValueError(
                f"{_where(group_index, p)} is also in {_where(owner[id(p)])}: some parameters "
                "appear in more than one parameter group"
            )
        seen.add(id(p))


# The kernels compute in fp32 and store in these; fp64 would be rounded through fp32 every step.
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARAM_DTYPE_SET = frozenset(PARAM_DTYPES)


def check_param_dtypes(group: dict, group_index: int) -> None:
    for p in group["params"]:
        # Complex and integer tensors are refused with their gradient (check_grad).
        if p.dtype.is_floating_point and p.dtype not in PARAM_DTYPES:
            raise ValueError(
                f"{_where(group_index, p)}: {p.dtype} parameters are not supported (the "
                f"updates compute in fp32); expected one of {PARAM_DTYPES}"
            )


def check_state_fits(group_index: int, param: Tensor, state: dict, fmt, shapes: dict) -> None:
    """A parameter whose shape changed since its state was created (``p.data = ...``) would
    be updated in part: refuse, and say how to start its state afresh. ``fmt``: the state's
    format, whose side tensors (8-bit scales) have a shape of their own; ``shapes``: the shape
    each state key's tensor has for the parameter's shape now (``Algorithm.state_shapes``)."""
    for key, value in state.items():
        expected = shapes.get(key, param.shape)
        if isinstance(value, Tensor) and not fmt.is_side(key) and value.shape != expected:
            raise ValueError(
                f"{_where(group_index, param)}: its {key!r} state has shape "
                f"{tuple(value.shape)}: the parameter changed shape since its state was "
                "created; to start its state afresh, del opt.state[param] before step()"
            )


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
    which: tuple | None = None  # the plan key's part naming the pairs (``_plan``), once made
    state_dicts: tuple[dict, ...] | None = None  # each parameter's state (``_ensure_state``)
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
                f"{_where(gi, p)}: {p.dtype} parameters are not supported; expected one "
                f"of {PARAM_DTYPES}"
            )
        if not local_param.is_contiguous():
            if local_param is not p:  # a DTensor's shard: FSDP2's are contiguous
                raise ValueError(f"{_where(gi, p)}: a DTensor's local tensor must be contiguous")
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


def read_torch_adamw_hyper(group: dict, group_index: int) -> Hyper:
    """A ``torch.optim.AdamW``-style group (``betas``, ``eps``) read as an adamw Hyper."""
    for flag in ("amsgrad", "maximize", "differentiable"):
        if group.get(flag):
            raise NotImplementedError(f"{_where(group_index)}: {flag}=True is not supported")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{_where(group_index)}: betas must be a pair, got {betas!r}")
    return Hyper(
        "adamw",
        _number(group, "lr", group_index),
        _number(group, "weight_decay", group_index),
        beta1=_beta(betas[0], "betas[0]", group_index),
        beta2=_beta(betas[1], "betas[1]", group_index),
        eps=_number(group, "eps", group_index),
    )
