"""A state format defined in this file alone, plugged into the engine through a policy
(``StatePolicy``, named by the optimizer's ``state_policy``: docs/design.md, "State formats"):
bf16 codes with one fp32 scale a block of 256, ``code = bf16(x / scale)``, ``scale`` the
block's absmax. It declares no kernels, so every unit steps through the decoded path
(``engine/decoded.py``): decoded to fp32, the dense update, encoded back. Checked here: the same
bits whatever the chunking or offload, Muon and AdamW; equal to a plain torch loop of the same
rules with this quantization in it (torch.optim.AdamW's own step for AdamW); state_dict round
trips bit for bit, and converts to and from dense state."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from _mixed_runs import same_state, same_tensors, state_copy

from muon_offload import AdamW, Muon
from muon_offload.engine.state_format import (
    MIN_QUANTIZED_NUMEL,
    Blockwise,
    Dense,
    StatePolicy,
)

from reference64 import orthogonalize64_batch

BLOCK = 256


@dataclass(frozen=True)
class BlockBf16(Blockwise):
    """bf16 codes, one fp32 absmax a block: ``x ~ code * scale``."""

    kernels = None  # no fused kernels: the decoded path
    code_bytes = 2
    label = "bf16 block-scaled"

    def code_dtype(self, kind: str) -> torch.dtype:
        return torch.bfloat16

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        padded = flat.new_zeros(-(-flat.numel() // self.block) * self.block)
        padded[: flat.numel()] = flat
        return padded.view(-1, self.block)

    def quantize(self, x, kind):
        blocks = self._blocks(x.reshape(-1).float())
        scales = blocks.abs().amax(dim=1)
        codes = (blocks / torch.where(scales > 0, scales, 1.0)[:, None]).bfloat16()
        return codes.reshape(-1)[: x.numel()].view(x.shape), scales

    def dequantize(self, codes, scales, kind):
        values = self._blocks(codes.reshape(-1).float()) * scales[:, None]
        return values.reshape(-1)[: codes.numel()].view(codes.shape)


class BlockPolicy(StatePolicy):
    """Tensors of 4096 elements and more in ``BlockBf16``, smaller ones dense fp32."""

    def format_for(self, param):
        if param.numel() >= MIN_QUANTIZED_NUMEL:
            return BlockBf16(BLOCK)
        return Dense(torch.float32)

    def block_scaled(self) -> bool:
        return True

    def loadable(self):
        return (BlockBf16(BLOCK), *super().loadable())


class BlockMuon(Muon):
    state_policy = BlockPolicy


class BlockAdamW(AdamW):
    state_policy = BlockPolicy


class KnowsBlocks(StatePolicy):
    """Dense state as ``state_dtype`` says, and checkpoints of ``BlockBf16`` state read."""

    def loadable(self):
        return (BlockBf16(BLOCK), *super().loadable())


class DenseMuon(Muon):
    state_policy = KnowsBlocks


class DenseAdamW(AdamW):
    state_policy = KnowsBlocks


# Quantized: the matrix, the stack (per matrix: 5120 elements, 20 blocks), 5000 (a partial
# last block) and 70 x 90 (flat blocks across rows); the 40-vector stays dense.
MUON_SHAPES = [(64, 96), (3, 32, 160)]
ADAMW_SHAPES = [(5000,), (70, 90), (40,)]
HYPER = dict(lr=0.02, weight_decay=0.1)
ADAMW_HYPER = dict(betas=(0.9, 0.95), eps=1e-8)


def _params(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _muon(cls=BlockMuon, **kw):
    muon, adamw = _params(MUON_SHAPES, 0), _params(ADAMW_SHAPES, 1)
    groups = [dict(params=muon), dict(params=adamw, algorithm="adamw")]
    hyper = dict(mu=0.95, betas=ADAMW_HYPER["betas"], epsilon=ADAMW_HYPER["eps"], **HYPER)
    opt = cls(groups, adjust_lr=None, orthogonalizer=orthogonalize64_batch, **hyper, **kw)
    return muon + adamw, opt


def _adamw(cls=BlockAdamW, **kw):
    params = _params(ADAMW_SHAPES, 2)
    return params, cls(params, **HYPER, **ADAMW_HYPER, **kw)


def _steps(params, opt, start, count):
    for s in range(start, start + count):
        for p, g in zip(params, _grads(params, s), strict=True):
            p.grad = g
        opt.step()


RUNS = [
    dict(offload=False),
    dict(offload=True),
    dict(offload=True, chunk_bytes=3000),  # element-wise cuts on blocks, the stack cut
    dict(offload=True, resident_bytes=20000, chunk_bytes=9000),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])  # the dense update's two paths
@pytest.mark.parametrize("build", [_muon, _adamw])
def test_same_bits_whatever_the_chunking_or_offload(build, backend):
    ref_params, ref = build(backend=backend)
    _steps(ref_params, ref, 0, 3)
    keys = ("momentum",) if build is _muon else ("exp_avg", "exp_avg_sq")
    first = ref.state[ref_params[0]]
    assert set(first) == {f"{k}_{part}" for k in keys for part in ("codes", "scales")}
    assert first[f"{keys[0]}_codes"].dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in ref.state[ref_params[-1]].values())  # small
    for kw in RUNS[1:] if backend == "torch" else RUNS[2:3]:
        params, opt = build(backend=backend, **kw)
        _steps(params, opt, 0, 3)
        assert same_tensors(ref_params, params), kw
        assert same_state(state_copy(ref, ref_params), state_copy(opt, params)), kw


def _roundtrip(x: torch.Tensor, rows: int) -> torch.Tensor:
    """The quantization written out: each of ``rows`` runs of x (a matrix each for Muon's
    momentum, the whole tensor otherwise) in blocks of 256, x ~ bf16(x / absmax) * absmax."""
    out = []
    for run in x.reshape(rows, -1).float():
        n = run.numel()
        blocks = torch.nn.functional.pad(run, (0, -n % BLOCK)).view(-1, BLOCK)
        scale = blocks.abs().amax(dim=1, keepdim=True)
        codes = (blocks / torch.where(scale > 0, scale, 1.0)).bfloat16()
        out.append((codes.float() * scale).reshape(-1)[:n])
    return torch.cat(out).view(x.shape)


def _torch_adamw_loop(params, steps):
    """torch.optim.AdamW (single-tensor, fp32) on copies; its state decoded before each step
    as the engine decodes ours, and quantized after it (fp32 below 4096 elements)."""
    params = [p.detach().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(params, **HYPER, **ADAMW_HYPER, foreach=False)
    for s in range(steps):
        for p, g in zip(params, _grads(params, s), strict=True):
            p.grad = g
        opt.step()
        for p in params:
            if p.numel() >= MIN_QUANTIZED_NUMEL:
                for key in ("exp_avg", "exp_avg_sq"):
                    opt.state[p][key].copy_(_roundtrip(opt.state[p][key], 1))
    return params, opt


def test_adamw_is_torch_adamw_with_the_quantization():
    """Bitwise: the decoded path hands torch.optim.AdamW's arithmetic (our fp32 AdamW, which
    tests/test_vs_torch_adamw.py holds bit for bit to torch's) the very values the loop's
    state holds, and the loop quantizes as the format does."""
    params, opt = _adamw(offload=True, chunk_bytes=3000)
    _steps(params, opt, 0, 3)
    ref_params, ref = _torch_adamw_loop(_params(ADAMW_SHAPES, 2), 3)
    assert same_tensors(params, ref_params)
    fmt = BlockBf16(BLOCK)
    for p, q in zip(params, ref_params, strict=True):
        for ours, theirs in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            state = opt.state[p]
            value = (
                fmt.decode(state[f"{ours}_codes"], state[f"{ours}_scales"], "adam_m")
                if f"{ours}_codes" in state
                else state[ours]
            )
            assert torch.equal(value, ref.state[q][theirs]), ours


def test_muon_is_a_torch_loop_with_the_quantization():
    """Muon's momentum, ``M = mu M + G``, decoded and quantized as the format does, is the
    loop's bit for bit (the same fp32 operations on the same values; the orthogonalizer is
    the float64 one both run, so the update depends on the engine only through its fp32
    steps). The weights may differ by the last bits of the fp32 apply
    (``x (1 - lr wd) - lr o``): a relative 1e-6 (fp32 epsilon is 1.2e-7, three steps)."""
    params, opt = _muon(offload=True, chunk_bytes=3000)
    _steps(params, opt, 0, 3)
    muon = [p.detach().clone() for p in _params(MUON_SHAPES, 0)]
    momenta = [torch.zeros_like(x) for x in muon]
    for s in range(3):
        for i, (x, g) in enumerate(
            zip(muon, _grads(muon + _params(ADAMW_SHAPES, 1), s)[:2], strict=True)
        ):
            rows = 1 if x.ndim == 2 else x.shape[0]
            m = momenta[i].mul_(0.95).add_(g)
            u = m.bfloat16().reshape(-1, *x.shape[-2:])
            o = orthogonalize64_batch(u).reshape(x.shape)
            x.mul_(1 - HYPER["lr"] * HYPER["weight_decay"]).sub_(o, alpha=HYPER["lr"])
            momenta[i] = _roundtrip(m, rows)
    fmt = BlockBf16(BLOCK)
    for p, x, m in zip(params, muon, momenta, strict=False):  # the Muon group's
        state = opt.state[p]
        assert torch.equal(fmt.decode(state["momentum_codes"], state["momentum_scales"], ""), m)
        torch.testing.assert_close(p.detach(), x, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("build", [_muon, _adamw])
def test_state_dict_round_trip_and_conversion(build):
    params, opt = build(offload=True, chunk_bytes=3000)
    _steps(params, opt, 0, 2)
    saved = copy.deepcopy(opt.state_dict())
    # Into a fresh optimizer of the format: bitwise, and it resumes as the original does.
    again_params, again = build(offload=True)
    for p, q in zip(params, again_params, strict=True):
        q.data.copy_(p.data)
    again.load_state_dict(saved)
    assert same_state(state_copy(opt, params), state_copy(again, again_params))
    _steps(params, opt, 2, 1)
    _steps(again_params, again, 2, 1)
    assert same_tensors(params, again_params)
    # Into dense fp32 state (decoded), and from it back (quantized as the format does). The
    # default policy does not know the format: it refuses the checkpoint.
    plain, dense = (Muon, DenseMuon) if build is _muon else (AdamW, DenseAdamW)
    _, refusing = build(cls=plain)
    with pytest.raises(ValueError, match="codes torch.bfloat16"):
        refusing.load_state_dict(opt.state_dict())
    dense_params, dense = build(cls=dense)
    dense.load_state_dict(copy.deepcopy(opt.state_dict()))
    fmt = BlockBf16(BLOCK)
    for p, q in zip(params, dense_params, strict=True):
        for name, t in dense.state[q].items():
            if f"{name}_codes" in opt.state[p]:
                codes, scales = opt.state[p][f"{name}_codes"], opt.state[p][f"{name}_scales"]
                assert torch.equal(t, fmt.decode(codes, scales, "")), name
    back_params, back = build()
    back.load_state_dict(dense.state_dict())
    assert same_state(state_copy(opt, params), state_copy(back, back_params))
