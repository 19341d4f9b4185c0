"""Where each update runs: the fused Triton kernels for CUDA tensors (or everywhere, under
the Triton interpreter, when asked), the torch references otherwise."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..kernels import elementwise, muon, orthogonalize

BACKENDS = ("auto", "triton", "torch")


def _use_triton(backend: str, tensor: Tensor) -> bool:
    return backend == "triton" or (backend == "auto" and tensor.is_cuda)


def adamw_(backend: str, params, grads, exp_avgs, exp_avg_sqs, **hyper) -> None:
    fn = elementwise.adamw_ if _use_triton(backend, params[0]) else elementwise.adamw_reference_
    fn(params, grads, exp_avgs, exp_avg_sqs, **hyper)


def lion_(backend: str, params, grads, exp_avgs, **hyper) -> None:
    fn = elementwise.lion_ if _use_triton(backend, params[0]) else elementwise.lion_reference_
    fn(params, grads, exp_avgs, **hyper)


def muon_prep(backend: str, momentums, grads, *, mu: float, nesterov: bool):
    fn = muon.muon_prep if _use_triton(backend, momentums[0]) else muon.muon_prep_reference
    return fn(momentums, grads, mu=mu, nesterov=nesterov)


def muon_apply_(backend: str, params, update: Tensor, **hyper) -> None:
    fn = muon.muon_apply_ if _use_triton(backend, params[0]) else muon.muon_apply_reference_
    fn(params, update, **hyper)


# 8-bit state (kernels/quantized_elementwise.py, kernels/quantized_muon.py), imported where it
# is used: a dense optimizer never loads it. Chosen as the dense kernels are: the kernels on
# CUDA (H200, triton 3.6, 2026-12-01: equal to the references bit for bit on the GPU, offloaded
# and resident 8-bit steps the same bits; docs/benchmarks.md), the references elsewhere.
def adamw8_(backend: str, params, grads, m_codes, m_scales, v_codes, v_scales, **hyper) -> None:
    from ..kernels import quantized_elementwise

    triton = _use_triton(backend, params[0])
    fn = quantized_elementwise.adamw8_ if triton else quantized_elementwise.adamw8_reference_
    fn(params, grads, m_codes, m_scales, v_codes, v_scales, **hyper)


def lion8_(backend: str, params, grads, m_codes, m_scales, **hyper) -> None:
    from ..kernels import quantized_elementwise

    triton = _use_triton(backend, params[0])
    fn = quantized_elementwise.lion8_ if triton else quantized_elementwise.lion8_reference_
    fn(params, grads, m_codes, m_scales, **hyper)


def muon_prep8(backend: str, m_codes, m_scales, grads, *, mu: float, nesterov: bool):
    from ..kernels import quantized_muon

    triton = _use_triton(backend, m_codes[0])
    fn = quantized_muon.muon_prep8 if triton else quantized_muon.muon_prep8_reference
    return fn(m_codes, m_scales, grads, mu=mu, nesterov=nesterov)


def orthogonalize_batch(
    update: Tensor,
    sumsq: Tensor | None,
    *,
    method,
    eps: float,
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
