"""Where each update runs: the fused Triton kernels for CUDA tensors (or everywhere, under
the Triton interpreter, when asked), the torch references otherwise."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..kernels import elementwise, elementwise_reference, muon, orthogonalize
from ..kernels._launch import device_scalars

BACKENDS = ("auto", "triton", "torch")


def _use_triton(backend: str, tensor: Tensor) -> bool:
    return backend == "triton" or (backend == "auto" and tensor.is_cuda)


def uses_triton(backend: str, device: torch.device) -> bool:
    """Whether a step on ``device`` runs the Triton kernels (and so reads a scalar table)."""
    return backend == "triton" or (backend == "auto" and device.type == "cuda")


# ``scalars``: the unit's row of the step's scalar table (``engine/scalars.py``), which the
# kernels read on the device; without it (a direct call) the launchers make one from the
# numbers. The torch references always take the numbers.
# ``grad_index``: where the kernels read the gradients' addresses (the step's gradient table,
# ``engine/grad_table.py``), None for the gradients' own; taken with ``scalars`` only.
# ``cautious_wd``: a compile-time flag of the kernels, so it goes with the table too.
def adamw_(
    backend: str, params, grads, exp_avgs, exp_avg_sqs, *, scalars=None, grad_index=None, **hyper
) -> None:
    state = (exp_avgs, exp_avg_sqs)
    if not _use_triton(backend, params[0]):
        elementwise_reference.adamw_reference_(params, grads, *state, **hyper)
    elif scalars is not None:
        cautious = hyper.get("cautious_wd", False)
        elementwise.adamw_from_(params, grads, *state, scalars, grad_index, cautious)
    else:
        elementwise.adamw_(params, grads, *state, **hyper)


def lion_(backend: str, params, grads, exp_avgs, *, scalars=None, grad_index=None, **hyper) -> None:
    if not _use_triton(backend, params[0]):
        elementwise_reference.lion_reference_(params, grads, exp_avgs, **hyper)
    elif scalars is not None:
        cautious = hyper.get("cautious_wd", False)
        elementwise.lion_from_(params, grads, exp_avgs, scalars, grad_index, cautious)
    else:
        elementwise.lion_(params, grads, exp_avgs, **hyper)


def muon_prep(backend: str, momentums, grads, *, mu, nesterov: bool, grad_index=None):
    """``mu``: a number, or (Triton path) the device tensor holding it."""
    if _use_triton(backend, momentums[0]):
        return muon.muon_prep(momentums, grads, mu=mu, nesterov=nesterov, grad_index=grad_index)
    return muon.muon_prep_reference(momentums, grads, mu=mu, nesterov=nesterov)


def muon_apply_(backend: str, params, update: Tensor, *, scalars=None, **hyper) -> None:
    if not _use_triton(backend, params[0]):
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
    if not _use_triton(backend, params[0]) or hyper.get("cautious_wd"):
        ortho = orthogonalize.orthogonalize(update, sumsq, method=method, eps=eps)
        muon_apply_(backend, params, ortho, scalars=scalars, **hyper)
        return
    hyper.pop("cautious_wd", None)  # False here
    if scalars is None:
        scalars = device_scalars(muon.apply_scalars(**hyper), params[0].device)
    orthogonalize.orthogonalize_apply_(update, sumsq, params, scalars, method=method, eps=eps)


# 8-bit state (kernels/quantized_elementwise.py, kernels/quantized_muon.py), imported where it
# is used: a dense optimizer never loads it. Chosen as the dense kernels are: the kernels on
# CUDA (H200, triton 3.6, 2026-12-01: equal to the references bit for bit on the GPU, offloaded
# and resident 8-bit steps the same bits; docs/benchmarks.md), the references elsewhere.
def adamw8_(
    backend: str,
    params,
    grads,
    m_codes,
    m_scales,
    v_codes,
    v_scales,
    *,
    scalars=None,
    grad_index=None,
    **hyper,
) -> None:
    from ..kernels import quantized_elementwise as q
    from ..kernels import quantized_elementwise_reference as r

    state = (m_codes, m_scales, v_codes, v_scales)
    if not _use_triton(backend, params[0]):
        r.adamw8_reference_(params, grads, *state, **hyper)
    elif scalars is not None:
        cautious = hyper.get("cautious_wd", False)
        q.adamw8_from_(params, grads, *state, scalars, grad_index, cautious)
    else:
        q.adamw8_(params, grads, *state, **hyper)


def lion8_(
    backend: str, params, grads, m_codes, m_scales, *, scalars=None, grad_index=None, **hyper
) -> None:
    from ..kernels import quantized_elementwise as q
    from ..kernels import quantized_elementwise_reference as r

    if not _use_triton(backend, params[0]):
        r.lion8_reference_(params, grads, m_codes, m_scales, **hyper)
    elif scalars is not None:
        cautious = hyper.get("cautious_wd", False)
        q.lion8_from_(params, grads, m_codes, m_scales, scalars, grad_index, cautious)
    else:
        q.lion8_(params, grads, m_codes, m_scales, **hyper)


def muon_prep8(backend: str, m_codes, m_scales, grads, *, mu, nesterov: bool, grad_index=None):
    from ..kernels import quantized_muon as q

    if _use_triton(backend, m_codes[0]):
        return q.muon_prep8(
            m_codes, m_scales, grads, mu=mu, nesterov=nesterov, grad_index=grad_index
        )
    return q.muon_prep8_reference(m_codes, m_scales, grads, mu=mu, nesterov=nesterov)


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
