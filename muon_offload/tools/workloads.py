"""Named optimizer workloads: lists of parameter shapes and the algorithm that updates each.

``qwen3-30b-a3b-ep8-rank`` is one rank's optimizer work when Qwen3-30B-A3B trains on 8 GPUs
with expert parallelism 8 (the bench workload); ``llama3-8b-fsdp8-rank`` is one rank's eighth
of a dense Llama-3-8B-like model on 8 GPUs; ``tiny`` is a few small matrices and vectors for
CPU runs. ``llama3-8b-fsdp8-rank-adamw`` and ``tiny-adamw`` are the same shapes with every
tensor on AdamW, for the peers that only run AdamW (torch's fused AdamW, torchao's
``CPUOffloadOptimizer``). docs/benchmarks.md ("Workloads") tables the large ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where parameters are made: the commands' --help skips it
    import torch


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    algorithm: str  # "muon" or "adamw"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


QWEN3_LAYERS = 48
QWEN3_LOCAL_EXPERTS = 16  # 128 experts / EP 8
QWEN3_ATTENTION_LAYERS = (0, 8, 16, 24, 32, 40)  # this rank's share of the attention weights


def qwen3_30b_a3b_ep8_rank(layers: int = QWEN3_LAYERS) -> list[ParamSpec]:
    """3,749,707,776 Muon and 77,987,840 AdamW parameters at 48 layers; ``layers`` keeps the
    first N layers (the embedding and lm_head shards stay)."""
    if not 0 <= layers <= QWEN3_LAYERS:
        raise ValueError(f"layers must be in [0, {QWEN3_LAYERS}], got {layers}")
    specs: list[ParamSpec] = []
    for i in range(layers):
        pre = f"layers.{i}"
        if i in QWEN3_ATTENTION_LAYERS:
            for proj, shape in (
                ("q", (4096, 2048)),
                ("k", (512, 2048)),
                ("v", (512, 2048)),
                ("o", (2048, 4096)),
            ):
                specs.append(ParamSpec(f"{pre}.attn.{proj}_proj", shape, "muon"))
        specs.append(ParamSpec(f"{pre}.mlp.router", (128, 2048), "muon"))
        for e in range(QWEN3_LOCAL_EXPERTS):
            for proj, shape in (("gate", (768, 2048)), ("up", (768, 2048)), ("down", (2048, 768))):
                specs.append(ParamSpec(f"{pre}.mlp.experts.{e}.{proj}_proj", shape, "muon"))
        specs.append(ParamSpec(f"{pre}.input_norm", (2048,), "adamw"))
        specs.append(ParamSpec(f"{pre}.post_attention_norm", (2048,), "adamw"))
    specs.append(ParamSpec("embed_tokens", (18992, 2048), "adamw"))
    specs.append(ParamSpec("lm_head", (18992, 2048), "adamw"))
    return specs


LLAMA3_LAYERS = 32
LLAMA3_RANKS = 8
LLAMA3_VOCAB = 128256


def llama3_8b_fsdp8_rank(layers: int = LLAMA3_LAYERS) -> list[ParamSpec]:
    """One rank's share of a dense Llama-3-8B-like model's optimizer work on 8 GPUs: a slice, as
    ``qwen3_30b_a3b_ep8_rank`` is. Muon orthogonalizes whole matrices, one per rank from each
    batch of same-shape matrices (as dion's sharded Muon does), so this rank's matrices are
    those of every 8th layer (0, 8, 16, 24), with those layers' norms; embedding and lm_head
    are 1/8 row shards. 872,415,232 Muon and 131,371,008 AdamW parameters at 32 layers
    (4.23 GiB of fp32 state); ``layers`` keeps the first N layers."""
    if not 0 <= layers <= LLAMA3_LAYERS:
        raise ValueError(f"layers must be in [0, {LLAMA3_LAYERS}], got {layers}")
    hidden, kv, ffn = 4096, 1024, 14336
    specs: list[ParamSpec] = []
    for i in range(0, layers, LLAMA3_RANKS):
        pre = f"layers.{i}"
        for name, shape in (
            ("attn.q_proj", (hidden, hidden)),
            ("attn.k_proj", (kv, hidden)),
            ("attn.v_proj", (kv, hidden)),
            ("attn.o_proj", (hidden, hidden)),
            ("mlp.gate_proj", (ffn, hidden)),
            ("mlp.up_proj", (ffn, hidden)),
            ("mlp.down_proj", (hidden, ffn)),
        ):
            specs.append(ParamSpec(f"{pre}.{name}", shape, "muon"))
        specs.append(ParamSpec(f"{pre}.input_norm", (hidden,), "adamw"))
        specs.append(ParamSpec(f"{pre}.post_attention_norm", (hidden,), "adamw"))
    specs.append(ParamSpec("norm", (hidden,), "adamw"))
    specs.append(ParamSpec("embed_tokens", (LLAMA3_VOCAB // LLAMA3_RANKS, hidden), "adamw"))
    specs.append(ParamSpec("lm_head", (LLAMA3_VOCAB // LLAMA3_RANKS, hidden), "adamw"))
    return specs


def tiny(layers: int = 2) -> list[ParamSpec]:
    """A few small matrices (wide, tall, odd) and vectors: runs on the CPU in seconds."""
    specs: list[ParamSpec] = []
    for i in range(layers):
        specs += [
            ParamSpec(f"layers.{i}.up", (48, 96), "muon"),
            ParamSpec(f"layers.{i}.down", (96, 48), "muon"),
            ParamSpec(f"layers.{i}.gate", (48, 96), "muon"),
            ParamSpec(f"layers.{i}.odd", (33, 70), "muon"),
            ParamSpec(f"layers.{i}.norm", (96,), "adamw"),
        ]
    specs.append(ParamSpec("embed", (100, 48), "adamw"))
    return specs


def all_adamw(specs: list[ParamSpec]) -> list[ParamSpec]:
    """The same shapes with every tensor on AdamW."""
    return [ParamSpec(s.name, s.shape, "adamw") for s in specs]


def llama3_8b_fsdp8_rank_adamw(layers: int = LLAMA3_LAYERS) -> list[ParamSpec]:
    """``llama3_8b_fsdp8_rank`` with every tensor on AdamW: 1,003,786,240 parameters at 32
    layers (7.48 GiB of fp32 state)."""
    return all_adamw(llama3_8b_fsdp8_rank(layers))


def tiny_adamw(layers: int = 2) -> list[ParamSpec]:
    """``tiny`` with every tensor on AdamW."""
    return all_adamw(tiny(layers))


WORKLOADS = {
    "qwen3-30b-a3b-ep8-rank": qwen3_30b_a3b_ep8_rank,
    "llama3-8b-fsdp8-rank": llama3_8b_fsdp8_rank,
    "llama3-8b-fsdp8-rank-adamw": llama3_8b_fsdp8_rank_adamw,
    "tiny": tiny,
    "tiny-adamw": tiny_adamw,
}
# Layers each workload has by default, and the most it can have (None: no limit).
DEFAULT_LAYERS = {
    "qwen3-30b-a3b-ep8-rank": QWEN3_LAYERS,
    "llama3-8b-fsdp8-rank": LLAMA3_LAYERS,
    "llama3-8b-fsdp8-rank-adamw": LLAMA3_LAYERS,
    "tiny": 2,
    "tiny-adamw": 2,
}
MAX_LAYERS = {
    "qwen3-30b-a3b-ep8-rank": QWEN3_LAYERS,
    "llama3-8b-fsdp8-rank": LLAMA3_LAYERS,
    "llama3-8b-fsdp8-rank-adamw": LLAMA3_LAYERS,
    "tiny": None,
    "tiny-adamw": None,
}
# Workloads whose every tensor is on AdamW: the AdamW-only peers run on these.
ADAMW_ONLY = frozenset(
    name for name, make in WORKLOADS.items() if all(s.algorithm == "adamw" for s in make())
)


def workload(name: str, layers: int | None = None) -> list[ParamSpec]:
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]() if layers is None else WORKLOADS[name](layers)


def materialize(
    specs: list[ParamSpec],
    device: torch.device | str = "cpu",
    *,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> list[torch.nn.Parameter]:
    """Parameters with random values and random (never zero) gradients of the same shapes
    (``dtype``: fp32 by default)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for spec in specs:
        p = torch.randn(spec.shape, generator=gen, device=device, dtype=torch.float32)
        p = torch.nn.Parameter(p.mul_(0.02).to(dtype))
        p.grad = torch.randn(spec.shape, generator=gen, device=device, dtype=torch.float32).to(
            dtype
        )
        params.append(p)
    return params
