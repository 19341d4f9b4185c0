"""bench/train_compare.py's data and model: byte-level text from the running Python's standard
library, and a small pre-norm GPT.

The corpus is the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (installed packages in
``site-packages`` / ``dist-packages`` left out, so two machines with the same Python version read
the same bytes), sorted by relative path; the last ``val_fraction`` of the files is validation.
Every batch is a set of random windows whose starts are drawn up front from a seeded CPU
generator, so every mode (and every device) sees the same data in the same order.
"""

from __future__ import annotations

import hashlib
import math
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from muon_offload import muon_param_groups

VOCAB = 256  # byte-level tokens
INSTALLED = {"site-packages", "dist-packages"}


@dataclass(frozen=True)
class Corpus:
    train: Tensor  # uint8, every training file's bytes back to back
    val: Tensor
    info: dict  # what was read, for the JSON: a run is only comparable on the same bytes


def stdlib_corpus(val_fraction: float = 0.05) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not INSTALLED & set(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    n_val = max(1, round(len(files) * val_fraction))
    if len(files) - n_val < 1:
        raise RuntimeError(f"only {len(files)} .py files under {root}: too few to split")
    digest = hashlib.sha256()

    def read(paths: list[Path]) -> Tensor:
        data = b"".join(p.read_bytes() for p in paths)
        digest.update(data)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    train, val = read(files[:-n_val]), read(files[-n_val:])
    info = {
        "source": "the .py files of the Python standard library, byte-level",
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "train_files": len(files) - n_val,
        "val_files": n_val,
        "first_val_file": files[-n_val].relative_to(root).as_posix(),
        "train_bytes": train.numel(),
        "val_bytes": val.numel(),
        "sha256": digest.hexdigest(),
    }
    return Corpus(train, val, info)


def window_starts(n_bytes: int, seq: int, batches: int, batch: int, seed: int) -> Tensor:
    """[batches, batch] starts of windows of ``seq + 1`` bytes (inputs and shifted targets)."""
    if n_bytes < seq + 2:
        raise ValueError(f"{n_bytes} bytes are too few for windows of {seq + 1}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(n_bytes - seq - 1, (batches, batch), generator=gen)


def windows(data: Tensor, starts: Tensor, seq: int) -> Tensor:
    """[batch, seq + 1] int64 tokens; ``data`` and ``starts`` on the same device."""
    idx = starts[:, None] + torch.arange(seq + 1, device=starts.device)
    return data[idx].long()


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)). No biases; Q, K and V as three
    weights, so Muon orthogonalizes each on its own."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim, eps=1e-6)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (
            f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )  # each [b, heads, t, head_dim]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    """Byte-level decoder: token and learned position embeddings, ``layers`` pre-norm blocks,
    a final RMSNorm and an untied head (so the embedding and the head each get an AdamW
    update of their own, as in the usual Muon setups). GPT-2's init: N(0, 0.02), the
    residual projections scaled by 1/sqrt(2 layers)."""

    def __init__(self, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if p.ndim < 2:
                continue  # norm weights keep their ones
            std = (
                0.02 / math.sqrt(2 * layers)
                if name.endswith(("proj.weight", "out.weight"))
                else 0.02
            )
            nn.init.normal_(p, std=std)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_of(model: GPT, tokens: Tensor, autocast: bool) -> Tensor:
    """Next-byte cross entropy (nats) of a [batch, seq + 1] window."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def muon_groups(model: GPT, adamw_lr: float) -> list[dict]:
    """``muon_param_groups``'s split: Muon (dion's keys) for the blocks' matrices; AdamW for
    the embeddings, the position table and the head (named: in a plain torch model they are a
    parameter and a Linear like any other) and the norms, without weight decay."""
    return muon_param_groups(
        model, adamw_lr=adamw_lr, adamw_weight_decay=0.0, adamw_params=("pos", "head.weight")
    )


def adamw_groups(model: GPT, weight_decay: float) -> list[dict]:
    """nanoGPT's split: weight decay on every matrix (embeddings and head included), none on
    the norms' vectors."""
    params = list(model.parameters())
    return [
        dict(params=[p for p in params if p.ndim >= 2], weight_decay=weight_decay),
        dict(params=[p for p in params if p.ndim < 2], weight_decay=0.0),
    ]
