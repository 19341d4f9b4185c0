"""Gradients of several dtypes among same-shape parameters (``grad_dtype = None``: fp32
weights with a bf16 gradient beside fp32 ones, as mixed-precision wrappers leave them). A
batch of matrices is one kernel launch with one gradient dtype, so such parameters batch
apart; the step equals stepping each parameter in a group of its own, bit for bit, and
nothing is refused mid-step."""

from __future__ import annotations

import pytest
import torch

from muon_offload import Muon

SHAPE = (24, 40)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)


def _model():
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(SHAPE, generator=gen)) for _ in GRAD_DTYPES]
    params.append(torch.nn.Parameter(torch.randn(300, generator=gen)))
    for p in params:
        p.grad_dtype = None  # a gradient may then differ from its parameter's dtype
    return params


def _grads(step):
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(SHAPE, generator=gen).to(dtype) for dtype in GRAD_DTYPES]
    return [*grads, torch.randn(300, generator=gen).to(torch.bfloat16)]


def _run(one_group_each, **kw):
    params = _model()
    hyper = dict(lr=0.02, mu=0.9, weight_decay=0.1, **kw)
    matrices, vector = params[:-1], params[-1:]
    groups = [dict(params=[p]) for p in matrices] if one_group_each else [dict(params=matrices)]
    groups.append(dict(params=vector, algorithm="adamw", lr=1e-3))
    opt = Muon(groups, **hyper)
    for step in range(3):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad()
    return params, [opt.state[p] for p in params]


@pytest.mark.parametrize(
    "kw",
    [
        dict(backend="triton"),
        dict(backend="triton", offload=True, chunk_bytes=8192),
        dict(backend="triton", state_dtype=torch.int8),
        dict(backend="torch"),
    ],
    ids=["triton", "triton-offload", "triton-int8", "torch"],
)
def test_mixed_gradient_dtypes_step_as_if_apart(kw):
    batched, batched_state = _run(False, **kw)
    apart, apart_state = _run(True, **kw)
    for a, b in zip(batched, apart, strict=True):
        assert torch.equal(a, b)
    for sa, sb in zip(batched_state, apart_state, strict=True):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key
