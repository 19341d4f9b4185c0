"""A matrix's Muon update has the same bits whatever batch it is orthogonalized in: the batch
size never picks a kernel, a config or a summation order (kernels/orthogonalize.py). So
``chunk_bytes``, offloading and the world size, which cut batches differently, cannot change
a step's result."""

from __future__ import annotations

import pytest
import torch
from _kernel_utils import INTERPRETED
from muon_offload.kernels.muon import muon_prep
from muon_offload.kernels.orthogonalize import orthogonalize, orthogonalize_on

METHODS = ["polar_express", "gram_newton_schulz"]
# The CPU's batches: alone, first of two, and inside a batch of six (the probe at 0, 1 and 2,
# ``_in_batches``). A batch only adds programs along the grid's batch axis (every program one
# matrix's tile), so larger ones prove no more here; the GPU cases go to 128.
CPU_BATCHES = (1, 2, 6)


def _in_batches(fn, probe: torch.Tensor, sizes, gen):
    """fn's result for ``probe`` when it sits at a different place in batches of ``sizes``
    (the others fresh random matrices)."""
    results = []
    for k, size in enumerate(sizes):
        batch = torch.randn((size, *probe.shape), generator=gen).to(probe.dtype)
        batch = batch.to(probe.device)
        at = (k * 7) % size
        batch[at] = probe
        results.append(fn(batch)[at])
    return results


# Interpreter: the Triton paths forced (as CUDA runs them), fp32 / fp16 input (bf16 dots are
# garbage there). 24 x 40 is one 32-wide tile with two K steps.
@pytest.mark.skipif(not INTERPRETED, reason="the Triton paths run on the CPU under the interpreter")
# Three cases only: each costs ~1 s of interpreted programs a matrix (15 to 19 launches).
# Polar Express and Newton-Schulz5 fold the normalization into the first iteration's products
# (the scale per matrix, read by index), wide and tall.
@pytest.mark.parametrize(
    "method, dtype, shape",
    [
        ("polar_express", torch.float32, (24, 40)),
        ("newton_schulz5", torch.float32, (40, 24)),  # tall: the .mT path
        ("gram_newton_schulz", torch.float16, (40, 24)),
    ],
    ids=str,
)
def test_orthogonalize_bits_do_not_depend_on_batch_cpu(method, dtype, shape):
    gen = torch.Generator().manual_seed(5)
    probe = torch.randn(shape, generator=gen).to(dtype)
    outs = _in_batches(
        lambda b: orthogonalize_on(b, method=method, products="triton_all"),
        probe,
        CPU_BATCHES,
        gen,
    )
    assert not torch.isnan(outs[0]).any()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.skipif(not INTERPRETED, reason="the kernels run on the CPU under the interpreter")
@pytest.mark.parametrize("m_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prep_bits_do_not_depend_on_batch_cpu(m_dtype):
    gen = torch.Generator().manual_seed(6)
    shape = (190, 200)  # two sum groups
    m0 = torch.randn(shape, generator=gen).to(m_dtype)
    g0 = torch.randn(shape, generator=gen)
    seen = []
    for size in CPU_BATCHES:
        ms = [torch.randn(shape, generator=gen).to(m_dtype) for _ in range(size)]
        gs = [torch.randn(shape, generator=gen) for _ in range(size)]
        at = size // 2
        ms[at], gs[at] = m0.clone(), g0
        out, sumsq = muon_prep(ms, gs, mu=0.95, nesterov=True)
        seen.append((out[at], sumsq[at], ms[at]))
    for out, sumsq, m in seen[1:]:
        assert torch.equal(out, seen[0][0]) and torch.equal(m, seen[0][2])
        assert torch.equal(sumsq, seen[0][1])


# --- GPU: bf16, the workload's shapes ------------------------------------------------------

GPU_SHAPES = [(768, 2048), (2048, 768), (128, 2048), (512, 2048), (4096, 2048), (2048, 4096)]
GPU_BATCHES = (1, 5, 16, 48, 128)
NAMES = ("U", "sumsq", "update", "update (own sums)")


@pytest.mark.cuda
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_orthogonalize_and_prep_bits_do_not_depend_on_batch_gpu(method, shape):
    """Prep (momentum, bf16 U, sum of squares) then orthogonalize, as a Muon step runs them,
    for one matrix in batches of 1 to 128 (2048x768 is the tall case, run on its .mT)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    m0 = torch.randn(shape, generator=gen, device="cuda")
    g0 = torch.randn(shape, generator=gen, device="cuda")
    first = None
    for size in GPU_BATCHES:
        at = (size * 7) % size
        ms = [torch.randn(shape, generator=gen, device="cuda") for _ in range(size)]
        gs = [torch.randn(shape, generator=gen, device="cuda") for _ in range(size)]
        ms[at], gs[at] = m0.clone(), g0
        u, sumsq = muon_prep(ms, gs, mu=0.95, nesterov=True)
        got = (u[at].clone(), sumsq[at].clone(), orthogonalize(u, sumsq, method=method)[at])
        got = (*got, orthogonalize(u, None, method=method)[at])  # its own sums (sharded path)
        assert torch.equal(u[at], got[0]), "orthogonalize wrote its input"
        del ms, gs, u
        if first is None:
            first = got
            assert torch.equal(got[2], got[3])
            continue
        for name, a, b in zip(NAMES, got, first, strict=True):
            assert torch.equal(a, b), f"{name} differs in a batch of {size}"


@pytest.mark.cuda
@pytest.mark.parametrize("orthogonalizer", METHODS)
def test_muon_chunking_and_offload_give_the_same_bits(orthogonalizer):
    """The qwen3 workload at 2 layers, 3 steps: chunk_bytes 32 MiB and the default, offload
    on and off (resident chunks of 32 MiB too), all end with the same parameters bit for bit:
    the Muon batches differ (5, 21 and more 768x2048 matrices a batch)."""
    from muon_offload import Muon
    from muon_offload.tools.workloads import materialize, qwen3_30b_a3b_ep8_rank

    specs = qwen3_30b_a3b_ep8_rank(2)

    def run(**kw):
        params = materialize(specs, "cuda", seed=0)
        muon = [p for p, s in zip(params, specs, strict=True) if s.algorithm == "muon"]
        other = [p for p, s in zip(params, specs, strict=True) if s.algorithm != "muon"]
        groups = [dict(params=muon), dict(params=other, algorithm="adamw")]
        opt = Muon(groups, lr=0.02, orthogonalizer=orthogonalizer, **kw)
        for step in range(3):
            gen = torch.Generator(device="cuda").manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, device="cuda").to(p.dtype)
            opt.step()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in params]

    base = run()
    for kw in (
        dict(chunk_bytes=32 << 20),
        dict(resident_chunk_bytes=32 << 20),
        dict(offload=True),
        dict(offload=True, chunk_bytes=32 << 20),
    ):
        other = run(**kw)
        for i, (a, b) in enumerate(zip(base, other, strict=True)):
            assert torch.equal(a, b), f"{specs[i].name} differs with {kw}"
