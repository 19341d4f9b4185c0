"""A loaded state dict's outline, checked before its entries (``checkpoint.py``): its
structure, its param groups against the optimizer's, and which of its state entries name no
parameter (a hook's own, carried through as torch carries them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


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
    listed = listed_keys(groups)
    for key, values in state.items():
        if (isinstance(key, int) or key in listed) and not isinstance(values, Mapping):
            raise ValueError(f"loaded state of parameter {key!r} is not a dict")
    return list(groups), state


def listed_keys(saved_groups) -> set:
    """The parameter keys the saved groups list: int indices, or the names that
    torch.distributed.checkpoint's state-dict helpers put in their place."""
    return {key for group in saved_groups for key in group["params"]}


def names_no_parameter(key, listed: set) -> bool:
    """Whether a saved state entry names no parameter: a key that no saved group lists and that
    is no int index (those must be listed: a parameter the groups lost)."""
    return key not in listed and not isinstance(key, int)


def carried(saved_state: Mapping, saved_groups) -> dict:
    """The entries that name no parameter: a hook's own, which torch's optimizers carry
    through ``state_dict`` and ``load_state_dict`` as they are."""
    listed = listed_keys(saved_groups)
    return {k: v for k, v in saved_state.items() if names_no_parameter(k, listed)}


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
