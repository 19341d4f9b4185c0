"""The demo's model and data (``muon-offload demo``, bench/host_time.py): a small GPT-like
transformer, its Muon / AdamW parameter groups, and batches from a fixed Markov chain."""

from __future__ import annotations

import torch
from torch import nn


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        x = self.blocks(x, mask=self.causal[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def param_groups(model: TinyGPT) -> list[dict]:
    """Muon for the hidden matrices; AdamW for embeddings, head, norms and biases.
    The attention's packed QKV projection is orthogonalized per block via split_sizes."""
    dim = model.embed.embedding_dim
    packed, matrices, other = [], [], []
    for name, p in model.named_parameters():
        if name.endswith("in_proj_weight"):
            packed.append(p)
        elif p.ndim == 2 and name.startswith("blocks."):
            matrices.append(p)
        else:
            other.append(p)
    return [
        dict(params=matrices),
        dict(params=packed, split_sizes=(dim, dim, dim)),
        dict(params=other, algorithm="adamw", lr=3e-3, weight_decay=0.0),
    ]


def markov_batches(vocab: int, seq: int, batch: int, seed: int):
    """Sequences from a fixed sparse random Markov chain: learnable, with a known floor."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=gen) * 3.0
    probs = torch.softmax(logits, dim=-1)
    while True:
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=gen)
        for t in range(seq):
            tokens[:, t + 1] = torch.multinomial(probs[tokens[:, t]], 1, generator=gen)[:, 0]
        yield tokens
