"""Loading a state dict into the engine's existing state tensors.

Everything is checked before anything is written: a state dict that does not fit raises
with the optimizer exactly as it was. Host slabs stay where they are; loaded values are
copied into them (or into resident state), converting dtype and device.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..distributed import local
from ..hyper import Hyper


def check_groups(param_groups: list[dict], saved_groups: list[dict]) -> list[dict]:
    """The groups after loading: saved settings, live parameters."""
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for i, (ours, saved) in enumerate(zip(param_groups, saved_groups, strict=True)):
        if len(ours["params"]) != len(saved["params"]):
            raise ValueError(
                f"param group {i}: loaded state dict has {len(saved['params'])} parameters, "
                f"the optimizer {len(ours['params'])}"
            )
    return [
        {**ours, **saved, "params": ours["params"]}
        for ours, saved in zip(param_groups, saved_groups, strict=True)
    ]


def check_state(
    param_groups: list[dict],
    saved_groups: list[dict],
    saved_state: dict,
    hypers: Sequence[Hyper],
    state_keys: dict[str, tuple[str, ...]],
) -> dict[Tensor, dict]:
    """Map each saved entry to its live parameter and check it holds every state tensor."""
    owner = {
        saved_id: (gi, p)
        for gi, (ours, saved) in enumerate(zip(param_groups, saved_groups, strict=True))
        for saved_id, p in zip(saved["params"], ours["params"], strict=True)
    }
    loaded: dict[Tensor, dict] = {}
    for saved_id, values in saved_state.items():
        gi, p = owner[saved_id]
        for key in state_keys[hypers[gi].algorithm]:
            value = values.get(key)
            if isinstance(value, Tensor):
                value = local(value)
            if not isinstance(value, Tensor) or value.numel() != local(p).numel():
                raise ValueError(
                    f"param group {gi} (parameter of shape {tuple(p.shape)}): loaded state "
                    f"{key!r} is {'missing' if value is None else tuple(value.shape)}"
                )
        loaded[p] = values
    return loaded


def copy_state(state: dict, params, hypers, state_keys, loaded: dict[Tensor, dict]) -> None:
    """Write loaded values into the live state tensors; state not in the dict is zeroed."""
    for gi, p in params:
        for key in state_keys[hypers[gi].algorithm]:
            target = local(state[p][key])
            if p in loaded:
                target.copy_(local(loaded[p][key]).reshape(target.shape))
            else:
                target.zero_()
