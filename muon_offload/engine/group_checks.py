"""The generic checks of param groups, gradients and parameters: everything here runs before
any parameter or state is touched, so a bad input raises with the optimizer exactly as it was.
The per-algorithm reading of a group's hyper-parameters is each algorithm's own
(``optim/hyper.py``); ``where`` names the place of a bad value for both."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def where(group_index: int | None, param: Tensor | None = None) -> str:
    """Where a bad value is: a param group (a parameter of it), or the constructor's arguments
    (``None``: the defaults, checked before any group is made)."""
    if group_index is None:
        return "constructor"
    if param is None:
        return f"param group {group_index}"
    return f"param group {group_index} (parameter of shape {tuple(param.shape)})"


def check_grad(param: Tensor, group_index: int) -> None:
    """Raise if ``param.grad`` cannot be used; None grads are the caller's to skip.
    Dtype and layout are read on the local tensors: on a DTensor each such method call would
    go through DTensor's dispatch, thousands of times a step."""
    grad = param.grad
    local_param = getattr(param, "_local_tensor", param)
    local_grad = getattr(grad, "_local_tensor", grad)
    if grad.is_sparse or local_grad.layout != torch.strided:
        raise TypeError(f"{where(group_index, param)}: sparse gradients are not supported")
    if local_grad.is_complex() or local_param.is_complex():
        raise TypeError(f"{where(group_index, param)}: complex tensors are not supported")
    if not local_grad.is_floating_point() or not local_param.is_floating_point():
        raise TypeError(
            f"{where(group_index, param)}: parameter and gradient must be floating point, "
            f"got {param.dtype} and {grad.dtype}"
        )
    if grad.shape != param.shape:
        raise ValueError(
            f"{where(group_index, param)}: gradient shape {tuple(grad.shape)} differs from "
            "the parameter's"
        )
    if local_grad.device != local_param.device:
        raise ValueError(
            f"{where(group_index, param)}: gradient is on {local_grad.device}, parameter on "
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
            raise ValueError(f"{where(group_index, p)} is listed twice in the group")
        if id(p) in owner:
            raise ValueError(
                f"{where(group_index, p)} is also in {where(owner[id(p)])}: some parameters "
                "appear in more than one parameter group"
            )
        seen.add(id(p))


# The kernels compute in fp32 and store in these; fp64 would be rounded through fp32 every step.
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_param_dtypes(group: dict, group_index: int) -> None:
    for p in group["params"]:
        # Complex and integer tensors are refused with their gradient (check_grad).
        if p.dtype.is_floating_point and p.dtype not in PARAM_DTYPES:
            raise ValueError(
                f"{where(group_index, p)}: {p.dtype} parameters are not supported (the "
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
                f"{where(group_index, param)}: its {key!r} state has shape "
                f"{tuple(value.shape)}: the parameter changed shape since its state was "
                "created; to start its state afresh, del opt.state[param] before step()"
            )
