"""Loading a state dict into the engine's existing state tensors, and pickling an optimizer.

Everything is checked before anything is written: a state dict that does not fit raises
``ValueError`` with the optimizer exactly as it was. Host slabs stay where they are; loaded
values are copied into them (or into resident state), converting dtype and device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ..distributed import local
from ..hyper import Hyper

# State may arrive in any of the dtypes our, dion's or torch's optimizers keep it in; others
# (fp64, integers, complex) are not optimizer state of these algorithms.
LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_structure(state_dict) -> tuple[list[dict], Mapping]:
    """The saved groups and state of a well-formed optimizer state dict."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"expected an optimizer state dict, got {type(state_dict).__name__}")
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, Sequence) or not isinstance(state, Mapping):
        raise ValueError("an optimizer state dict has 'param_groups' (a list) and 'state' (a dict)")
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), Sequence):
            raise ValueError(f"loaded param group {i} is not a dict with a 'params' list")
    for key, values in state.items():
        if not isinstance(values, Mapping):
            raise ValueError(f"loaded state of parameter {key!r} is not a dict")
    return list(groups), state


def check_groups(param_groups: list[dict], saved_groups: list[dict]) -> list[dict]:
    """The groups after loading: saved settings, live parameters."""
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer "
            f"{len(param_groups)}"
        )
    for i, (ours, saved) in enumerate(zip(param_groups, saved_groups, strict=True)):
        if len(ours["params"]) != len(saved["params"]):
            raise ValueError(
                f"param group {i}: loaded state dict has {len(saved['params'])} parameters, "
                f"the optimizer {len(ours['params'])}"
            )
        algorithm = saved.get("algorithm", ours.get("algorithm"))
        if algorithm != ours.get("algorithm"):
            # The state of one algorithm is not the state of another (momentum alone vs
            # momentum and variance); change a group's algorithm in a new optimizer instead.
            raise ValueError(
                f"param group {i}: loaded algorithm {algorithm!r} differs from the optimizer's "
                f"{ours.get('algorithm')!r}"
            )
    return [
        {**ours, **saved, "params": ours["params"]}
        for ours, saved in zip(param_groups, saved_groups, strict=True)
    ]


def check_state(
    param_groups: list[dict],
    saved_groups: list[dict],
    saved_state: Mapping,
    hypers: Sequence[Hyper],
    state_keys: dict[str, tuple[str, ...]],
) -> dict[Tensor, dict[str, Tensor]]:
    """Map each saved entry to its live parameter; check it holds every state tensor, in the
    parameter's shape and a floating dtype. Returns live parameter -> {key: local tensor}."""
    owner = {
        saved_id: (gi, p)
        for gi, (ours, saved) in enumerate(zip(param_groups, saved_groups, strict=True))
        for saved_id, p in zip(saved["params"], ours["params"], strict=True)
    }
    loaded: dict[Tensor, dict[str, Tensor]] = {}
    for saved_id, values in saved_state.items():
        if saved_id not in owner:
            raise ValueError(f"loaded state names parameter {saved_id!r}, which no group lists")
        gi, p = owner[saved_id]
        where = f"param group {gi} (parameter of shape {tuple(p.shape)})"
        entry = {}
        for key in state_keys[hypers[gi].algorithm]:
            value = values.get(key)
            if not isinstance(value, Tensor):
                raise ValueError(f"{where}: loaded state {key!r} is missing")
            if tuple(value.shape) != tuple(p.shape) or local(value).shape != local(p).shape:
                raise ValueError(
                    f"{where}: loaded state {key!r} has shape {tuple(value.shape)}, not the "
                    "parameter's"
                )
            if value.dtype not in LOADABLE_DTYPES:
                raise ValueError(
                    f"{where}: loaded state {key!r} is {value.dtype}; expected one of "
                    f"{LOADABLE_DTYPES}"
                )
            entry[key] = local(value)
        loaded[p] = entry
    return loaded


def detach_aliases(loaded: dict[Tensor, dict[str, Tensor]], state: dict) -> None:
    """Copy loaded tensors that share memory with live state (our own ``state_dict()``
    reloaded, perhaps with entries swapped): copying one into place would change another
    before it is read."""
    live = {
        local(t).untyped_storage().data_ptr()
        for values in state.values()
        for t in values.values()
        if isinstance(t, Tensor)
    }
    for entry in loaded.values():
        for key, value in entry.items():
            if value.untyped_storage().data_ptr() in live:
                entry[key] = value.clone()


def copy_state(state: dict, params, hypers, state_keys, loaded: dict[Tensor, dict]) -> None:
    """Write loaded values into the live state tensors; state not in the dict is zeroed."""
    for gi, p in params:
        for key in state_keys[hypers[gi].algorithm]:
            target = local(state[p][key])
            if p in loaded:
                target.copy_(loaded[p][key])
            else:
                target.zero_()
