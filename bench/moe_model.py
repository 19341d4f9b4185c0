"""The Qwen3-30B-A3B-like model of bench/multi_gpu.py: its tensors, seeded random values the
same on every rank, dim-0 shards as FSDP2 lays them out, and the param groups.

Global shapes per layer: attention q 4096x2048, k and v 512x2048, o 2048x4096; router
128x2048; 128 experts as stacks gate and up [128, 768, 2048], down [128, 2048, 768]; two norms
(2048,); then embedding and lm_head 151936x2048. Dense tensors are sharded on dim 0 over a
mesh of every rank, expert stacks on their expert dim over the expert-parallel mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from muon_offload.distributed import local


@dataclass(frozen=True)
class Dims:
    hidden: int
    q_rows: int  # attention heads x head dim
    kv_rows: int
    experts: int
    expert_ffn: int
    vocab: int


QWEN3_30B_A3B = Dims(
    hidden=2048, q_rows=4096, kv_rows=512, experts=128, expert_ffn=768, vocab=151936
)
QWEN3_LAYERS = 48
# Seconds on CPUs: small matrices, an odd vocabulary (uneven embedding shards: 72 + 71 rows on
# 2 ranks), whose 4,576-element embedding and head are the tensors large enough for 8-bit state
# (4,096 elements); 72 x 32 = 9 blocks of 256, so 2 ranks' 8-bit blocks are one process's.
TINY = Dims(hidden=32, q_rows=64, kv_rows=16, experts=4, expert_ffn=24, vocab=143)
TINY_LAYERS = 2


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # global
    role: str  # "dense": Muon, FSDP mesh; "experts": Muon, expert mesh; "adamw": FSDP mesh


ROLES = ("dense", "experts", "adamw")


def model_specs(d: Dims, layers: int) -> list[TensorSpec]:
    h, ffn = d.hidden, d.expert_ffn
    specs = []
    for i in range(layers):
        pre = f"layers.{i}"
        specs += [
            TensorSpec(f"{pre}.attn.q_proj", (d.q_rows, h), "dense"),
            TensorSpec(f"{pre}.attn.k_proj", (d.kv_rows, h), "dense"),
            TensorSpec(f"{pre}.attn.v_proj", (d.kv_rows, h), "dense"),
            TensorSpec(f"{pre}.attn.o_proj", (h, d.q_rows), "dense"),
            TensorSpec(f"{pre}.mlp.router", (d.experts, h), "dense"),
            TensorSpec(f"{pre}.mlp.experts.gate_proj", (d.experts, ffn, h), "experts"),
            TensorSpec(f"{pre}.mlp.experts.up_proj", (d.experts, ffn, h), "experts"),
            TensorSpec(f"{pre}.mlp.experts.down_proj", (d.experts, h, ffn), "experts"),
            TensorSpec(f"{pre}.input_norm", (h,), "adamw"),
            TensorSpec(f"{pre}.post_attention_norm", (h,), "adamw"),
        ]
    specs.append(TensorSpec("embed_tokens", (d.vocab, h), "adamw"))
    specs.append(TensorSpec("lm_head", (d.vocab, h), "adamw"))
    return specs


PARAM_SEED, GRAD_SEED = 1, 2  # what a seed draws, folded in with the tensor's index
PARITY_SEED = 7  # the parity model's parameters and gradients: not the timed model's


def seed_of(*parts: int) -> int:
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + part) % (1 << 63)
    return seed


def random_full(shape: tuple[int, ...], seed: int, device: torch.device) -> Tensor:
    """A whole global tensor, the same on every rank (one generator per tensor)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device)


def shard_dim0(full: Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's dim-0 shard of ``full`` as FSDP2 and DTensor's Shard(0) lay it out
    (torch.chunk's pieces; trailing ranks empty when there are fewer pieces), copied so that
    the full tensor can be freed."""
    pieces = torch.chunk(full, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    mine = pieces[rank].clone() if rank < len(pieces) else full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(
        mine, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
    )


def build_params(specs, meshes: dict, device, seed: int) -> list[torch.nn.Parameter]:
    params = []
    for i, spec in enumerate(specs):
        full = random_full(spec.shape, seed_of(seed, PARAM_SEED, i), device).mul_(0.02)
        params.append(torch.nn.Parameter(shard_dim0(full, meshes[spec.role])))
        del full  # one global tensor at a time: the 48-layer model is 31 G elements
    return params


def set_grads(params, specs, seed: int, step: int) -> None:
    for i, (p, spec) in enumerate(zip(params, specs, strict=True)):
        full = random_full(spec.shape, seed_of(seed, GRAD_SEED, step, i), local(p).device)
        p.grad = shard_dim0(full, p.device_mesh)
        del full


def param_groups(params, specs, expert_mesh: DeviceMesh | None, adamw_lr: float) -> list[dict]:
    """Muon for dense matrices and for the experts (on their own mesh when given), AdamW (at
    ``adamw_lr``) for the rest."""
    by_role = {
        role: [p for p, s in zip(params, specs, strict=True) if s.role == role] for role in ROLES
    }
    experts = dict(params=by_role["experts"])
    if expert_mesh is not None:
        experts["distributed_mesh"] = expert_mesh
    return [
        dict(params=by_role["dense"]),
        experts,
        dict(params=by_role["adamw"], algorithm="adamw", lr=adamw_lr),
    ]


def state_bytes(params, specs, itemsize: int = 4) -> int:
    """This rank's optimizer state: momentum for Muon, momentum and variance for AdamW."""
    return sum(
        (2 if s.role == "adamw" else 1) * local(p).numel() * itemsize
        for p, s in zip(params, specs, strict=True)
    )
