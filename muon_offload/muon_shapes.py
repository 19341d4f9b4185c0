"""How a Muon parameter is seen as matrices, and dion's learning-rate adjustment from their
shape: Muon's rules, read by its update and by the 8-bit state's scales (one block row per
matrix)."""

from __future__ import annotations

import math

import torch


def matrix_view_shape(shape: torch.Size, flatten: bool) -> tuple[int, int]:
    """The [m, n] of the matrices a muon parameter is orthogonalized as."""
    if flatten:
        return shape[0], math.prod(shape[1:])
    return shape[-2], shape[-1]


def matrix_count(shape: torch.Size, flatten: bool) -> int:
    return 1 if flatten else math.prod(shape[:-2])


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
