"""Muon's launchers: the fused Triton kernels for CUDA tensors (or everywhere, under the Triton
interpreter, with ``backend="triton"``), their torch references otherwise; the 8-bit momentum's
(kernels/quantized_muon.py, imported where it is used: a dense optimizer never loads it) beside
the dense one's, ``MuonUpdate`` picking one by the unit's state format.

``scalars``: the unit's row of the step's scalar table (``engine/scalars.py``), which the
kernels read on the device; without it (a direct call) the launchers make one from the
numbers. The torch references always take the numbers. ``grad_index``: where the kernels read
the gradients' addresses (the step's gradient table, ``engine/grad_table.py``), None for the
gradients' own. ``cautious_wd``: a compile-time flag of the kernels."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..engine.algorithm import runs_triton
from ..kernels import muon, orthogonalize
from ..kernels._launch import device_scalars


def muon_prep(backend: str, momentums, grads, *, mu, nesterov: bool, grad_index=None):
    """``mu``: a number, or (Triton path) the device tensor holding it."""
    if runs_triton(backend, momentums[0].device):
        return muon.muon_prep(momentums, grads, mu=mu, nesterov=nesterov, grad_index=grad_index)
    return muon.muon_prep_reference(momentums, grads, mu=mu, nesterov=nesterov)


def muon_prep8(backend: str, m_codes, m_scales, grads, *, mu, nesterov: bool, grad_index=None):
    """``muon_prep`` on 8-bit momentum: decoded, updated and encoded again in one pass (the
    kernels on CUDA: H200, triton 3.6, 2026-12-01, equal to the references bit for bit on the
    GPU; docs/benchmarks.md)."""
    from ..kernels import quantized_muon as q

    if runs_triton(backend, m_codes[0].device):
        return q.muon_prep8(
            m_codes, m_scales, grads, mu=mu, nesterov=nesterov, grad_index=grad_index
        )
    return q.muon_prep8_reference(m_codes, m_scales, grads, mu=mu, nesterov=nesterov)


def muon_apply_(backend: str, params, update: Tensor, *, scalars=None, **hyper) -> None:
    if not runs_triton(backend, params[0].device):
        muon.muon_apply_reference_(params, update, **hyper)
    elif scalars is not None:
        muon.muon_apply_from_(params, update, scalars, hyper.get("cautious_wd", False))
    else:
        muon.muon_apply_(params, update, **hyper)


def orthogonalize_apply_(
    backend: str, params, update: Tensor, sumsq, *, method, eps, scalars=None, **hyper
) -> None:
    """``orthogonalize_batch`` then ``muon_apply_`` (no ``split_sizes``), the apply fused
    into the orthogonalization's last product where it runs on Triton (bit for bit the
    same: kernels/orthogonalize.py ``orthogonalize_apply_``). ``cautious_wd`` (its sign test
    is the apply kernel's alone) takes the unfused pair."""
    if not runs_triton(backend, params[0].device) or hyper.get("cautious_wd"):
        ortho = orthogonalize.orthogonalize(update, sumsq, method=method, eps=eps)
        muon_apply_(backend, params, ortho, scalars=scalars, **hyper)
        return
    hyper.pop("cautious_wd", None)  # False here
    if scalars is None:
        scalars = device_scalars(muon.apply_scalars(**hyper), params[0].device)
    orthogonalize.orthogonalize_apply_(update, sumsq, params, scalars, method=method, eps=eps)


def orthogonalize_batch(
    update: Tensor,
    sumsq: Tensor | None,
    *,
    method,
    eps,
    split_sizes: Sequence[int] | None = None,
    split_scales: Sequence[float] | None = None,
) -> Tensor:
    """Orthogonalize [B, m, n]; with ``split_sizes``, each row block on its own (as dion
    does for packed parameters), blocks of equal height batched together, each block then
    scaled by its ``split_scales`` entry."""
    if split_sizes is None:
        return orthogonalize.orthogonalize(update, sumsq, method=method, eps=eps)
    blocks = list(update.split(list(split_sizes), dim=-2))
    out: list[Tensor | None] = [None] * len(blocks)
    by_rows: dict[int, list[int]] = {}
    for i, block in enumerate(blocks):
        by_rows.setdefault(block.size(-2), []).append(i)
    batch = update.size(0)
    for idx in by_rows.values():
        stacked = torch.cat([blocks[i] for i in idx], dim=0)  # [len(idx) * B, rows, n]
        ortho = orthogonalize.orthogonalize(stacked, None, method=method, eps=eps)
        for j, i in enumerate(idx):
            block = ortho[j * batch : (j + 1) * batch]
            out[i] = block * split_scales[i] if split_scales is not None else block
    return torch.cat(out, dim=-2)
