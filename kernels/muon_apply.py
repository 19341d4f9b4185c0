"""Muon's apply, ``p = p (1 - lr wd) - adjusted_lr u``, where two kernels share it: the apply
kernel of ``muon.py`` and ``poly_apply``'s epilogue, which applies the orthogonalization's
last product to the parameters instead of storing it (``ParamApply`` describes them there).
One expression (``apply_step``) and one set of checks (``check_apply``), so that the fused
apply has the unfused one's bits and refuses what it refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._launch import DTYPE, check_lists, check_scalars
from ._triton import tl, triton


class ParamApply(NamedTuple):
    """Muon's apply fused into ``poly_apply``'s epilogue (``param_apply`` builds it):
    ``p = p (1 - lr wd) - adjusted_lr u`` on matrix i's parameter, u the product rounded as
    ``out`` would be. The product's element (r, c) is the parameter's element at
    ``r strides[0] + c strides[1]``."""

    table: Tensor  # B int64, contiguous: the addresses (kernels/_launch.py's TABLES)
    dtype: torch.dtype
    strides: tuple[int, int]
    scalars: Tensor  # fp32 [2]: 1 - lr wd, adjusted_lr (apply_scalars)
    aligned: bool  # every address a multiple of 16 bytes

    @property
    def mT(self) -> ParamApply:
        """The same parameters, for the product's transpose (a tall update runs on .mT)."""
        return self._replace(strides=self.strides[::-1])


@triton.jit
def apply_step(x, u, decay, alpha):
    """x (1 - lr wd) - adjusted_lr u in fp32, for the apply kernel and ``poly_apply``'s fused
    epilogue alike: the product with decay rounded, then one fma. Spelled out: with fp fusion
    on, the compiler may contract ``x * decay - alpha * u`` into either product's fma, and
    nothing makes it choose alike in two kernels (the fused apply must give the unfused bits)."""
    return tl.fma(-alpha, u, x * decay)


def check_apply(params: Sequence[Tensor], update: Tensor, scalars: Tensor) -> tuple[int, int]:
    """Validate an apply's operands (one contiguous parameter of rows x cols elements per
    matrix of update [B, rows, cols], one dtype, update's device; ``scalars`` fp32 [2]);
    return (rows, cols)."""
    check_lists(("params",), (params,))
    batch = len(params)
    if not batch:
        raise ValueError("params: empty batch")
    if update.ndim != 3 or update.shape[0] != batch:
        raise ValueError(f"update must be [{batch}, m, n], got {tuple(update.shape)}")
    rows, cols = update.shape[1], update.shape[2]
    device = params[0].device
    usual = set(map(Tensor.numel, params)) == {rows * cols} and len(set(map(DTYPE, params))) == 1
    for i, x in enumerate(() if usual else params):  # the first that differs
        if x.numel() != rows * cols or x.dtype != params[0].dtype:
            raise ValueError(
                f"params[{i}]: {x.numel()} elements of {x.dtype}, expected "
                f"{rows * cols} of {params[0].dtype}"
            )
    if update.device != device:
        raise ValueError(f"update is on {update.device}, params on {device}")
    check_scalars(scalars, 2, device)
    return rows, cols
