"""Reading each algorithm's hyper-parameters from a param group (``read_hyper``, and
``torch.optim.AdamW``'s keys for ``AdamW``) and checking the constructors' betas: everything
here runs before any parameter or state is touched, so a bad input raises with the optimizer
exactly as it was. The generic checks (parameters, gradients, dtypes) are the engine's
(``engine/group_checks.py``)."""

from __future__ import annotations

import math
from functools import partial

from torch import Tensor

from ..engine.algorithm import Hyper
from ..engine.group_checks import where
from .muon_shapes import read_num_heads

ALGORITHMS = ("muon", "adamw", "lion")
ADJUST_LR_MODES = ("spectral_norm", "rms_norm", None)


def _number(group: dict, key: str, group_index: int) -> float:
    value = group[key]
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.device.type != "cpu":
            # Reading a device tensor would sync the host with the GPU on every step.
            raise ValueError(
                f"{where(group_index)}: {key} must be a number or a one-element CPU tensor, "
                f"got a tensor of shape {tuple(value.shape)} on {value.device}"
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where(group_index)}: {key} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{where(group_index)}: {key} must be finite and >= 0, got {value}")
    return value


def _beta(value, name: str, group_index: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where(group_index)}: {name} must be a number, got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{where(group_index)}: {name} must be in [0, 1), got {value}")
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
            f"{where(group_index)}: unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}"
        )
    lr = _number(group, "lr", group_index)
    weight_decay = _number(group, "weight_decay", group_index)
    cautious_wd = bool(group.get("cautious_wd", False))
    if algorithm == "muon":
        adjust_lr = group.get("adjust_lr")
        if adjust_lr not in ADJUST_LR_MODES:
            raise ValueError(
                f"{where(group_index)}: unknown adjust_lr {adjust_lr!r}; "
                f"expected one of {ADJUST_LR_MODES}"
            )
        for p in group["params"]:
            if p.ndim < 2:
                raise ValueError(
                    f"{where(group_index, p)}: a muon group needs matrices (2 or more dims); "
                    "put vectors and scalars in an adamw or lion group"
                )
        num_heads = read_num_heads(group, partial(where, group_index))
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
            f"{where(group_index)}: split_sizes must be 2 or more positive ints, "
            f"got {split_sizes!r}"
        )
    if group.get("flatten"):
        raise ValueError(f"{where(group_index)}: split_sizes is incompatible with flatten=True")
    for p in group["params"]:
        if p.ndim != 2 or p.shape[0] != sum(split_sizes):
            raise ValueError(
                f"{where(group_index, p)}: split_sizes {tuple(split_sizes)} must sum to dim 0 "
                "of a 2-D parameter"
            )
    return tuple(split_sizes)


def read_torch_adamw_hyper(group: dict, group_index: int) -> Hyper:
    """A ``torch.optim.AdamW``-style group (``betas``, ``eps``) read as an adamw Hyper."""
    for flag in ("amsgrad", "maximize", "differentiable"):
        if group.get(flag):
            raise NotImplementedError(f"{where(group_index)}: {flag}=True is not supported")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where(group_index)}: betas must be a pair, got {betas!r}")
    return Hyper(
        "adamw",
        _number(group, "lr", group_index),
        _number(group, "weight_decay", group_index),
        beta1=_beta(betas[0], "betas[0]", group_index),
        beta2=_beta(betas[1], "betas[1]", group_index),
        eps=_number(group, "eps", group_index),
    )
