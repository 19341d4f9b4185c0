"""How a Muon parameter is seen as matrices, and dion's learning-rate adjustment from their
shape: Muon's rules, read by its update and by the 8-bit state's scales (one block row per
matrix). With dion's ``num_heads`` a 2-D weight of ``num_heads * head_dim`` rows is a stack
of ``num_heads`` matrices of ``head_dim`` rows (``heads_view``): each head is orthogonalized
on its own and its lr adjusted by its own shape, as dion's ``_prepare_head_split`` does."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def matrix_view_shape(shape: torch.Size, flatten: bool) -> tuple[int, int]:
    """The [m, n] of the matrices a muon parameter is orthogonalized as."""
    if flatten:
        return shape[0], math.prod(shape[1:])
    return shape[-2], shape[-1]


def matrix_count(shape: torch.Size, flatten: bool) -> int:
    return 1 if flatten else math.prod(shape[:-2])


def heads_view(shape, num_heads: int | None) -> tuple[int, ...]:
    """The shape a Muon parameter is updated as: ``(num_heads, head_dim, cols)`` for a
    per-head group (rows split into consecutive heads, dim 0 as dion splits it), else its own."""
    if num_heads is None:
        return tuple(shape)
    return (num_heads, shape[0] // num_heads, shape[1])


def read_num_heads(group: dict, where: Callable) -> int | None:
    """A Muon group's ``num_heads``, checked as dion checks it (``_resolve_num_heads``,
    ``_prepare_head_split``): None when unset or 1. ``where(p)`` names the group (``p=None``)
    or one of its parameters, for the errors."""
    num_heads = group.get("num_heads")
    if num_heads is None:
        return None
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"{where(None)}: num_heads must be a positive int, got {num_heads!r}")
    if num_heads == 1:
        return None
    if group.get("flatten"):
        raise ValueError(
            f"{where(None)}: num_heads > 1 is incompatible with flatten=True (flattening the "
            "heads would make them one matrix again)"
        )
    if group.get("split_sizes") is not None:
        raise ValueError(
            f"{where(None)}: split_sizes is incompatible with num_heads > 1: num_heads for "
            "equal heads, split_sizes for uneven row blocks, not both"
        )
    for p in group["params"]:
        if p.ndim != 2 or p.shape[0] % num_heads:
            raise ValueError(
                f"{where(p)}: num_heads ({num_heads}) must divide dim 0 of a 2-D parameter"
            )
    return num_heads


def adjusted_lr(lr: float, shape: torch.Size, adjust_lr: str | None, flatten: bool) -> float:
    """dion's learning-rate adjustment from the matrix shape (fan_out, fan_in)."""
    fan_out, fan_in = matrix_view_shape(shape, flatten)
    if adjust_lr is None:
        return lr
    if adjust_lr == "spectral_norm":
        return lr * math.sqrt(fan_out / fan_in)
    return lr * 0.2 * math.sqrt(max(fan_out, fan_in))


def split_lr_scales(split_sizes, shape, adjust_lr: str | None) -> tuple[float, ...] | None:
    """Per-block factors turning the whole-matrix adjustment into each block's own."""
    if adjust_lr is None:
        return None
    full = adjusted_lr(1.0, shape, adjust_lr, False)
    return tuple(
        adjusted_lr(1.0, torch.Size((rows, shape[-1])), adjust_lr, False) / full
        for rows in split_sizes
    )
