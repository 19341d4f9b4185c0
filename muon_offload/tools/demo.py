"""``muon-offload demo``: train a small GPT-like model with offloaded Muon and with resident
Muon side by side, and show both losses falling together.

Runs on whatever device exists: on a GPU the state streams from pinned host memory; on a
CPU-only machine the same chunked pipeline runs through its CPU path.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .. import Muon
from . import options

DESCRIPTION = (
    "Train a small GPT-like model with offloaded Muon and with resident Muon side by side, "
    "and show both losses falling together."
)


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


def parser():
    ap = options.parser("muon-offload demo", DESCRIPTION)
    ap.add_argument("--steps", type=int, default=200, help="training steps")
    ap.add_argument(
        "--device",
        type=options.torch_device,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda where a GPU is available, else cpu)",
    )
    ap.add_argument(
        "--chunk-bytes",
        type=int,
        default=256 << 10,
        help="the offloaded optimizer's chunk size, small so that even this model streams in "
        "many pieces",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.chunk_bytes < 1:
        ap.error("--chunk-bytes must be >= 1")
    if args.device is None:
        args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options.check_device(ap, args.device)
    device = args.device
    vocab, dim, layers, heads, seq, batch = 64, 64, 2, 4, 32, 16

    torch.manual_seed(0)
    models = [TinyGPT(vocab, dim, layers, heads, seq).to(device) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [
        Muon(param_groups(models[0]), lr=0.02),
        Muon(param_groups(models[1]), lr=0.02, offload=True, chunk_bytes=args.chunk_bytes),
    ]
    print(
        f"device {device}; {sum(p.numel() for p in models[0].parameters()):,} parameters; "
        f"offloaded chunks of {args.chunk_bytes:,} bytes",
        flush=True,
    )
    data = markov_batches(vocab, seq, batch, seed=1)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(1, args.steps + 1):
        tokens = next(data).to(device)
        losses, elapsed = [], 0.0
        for model, opt in zip(models, optimizers, strict=True):
            logits = model(tokens[:, :-1])
            loss = loss_fn(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        if step == 1:
            # After the first step: the optimizer's one-time notices (the CPU path of
            # offload=True, oversized chunks) are logged in it, so they land above the table.
            print(
                f"{'step':>5} {'loss resident':>14} {'loss offloaded':>15} {'step ms (offl.)':>16}"
            )
        if step == 1 or step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(f"{step:>5} {losses[0]:>14.4f} {losses[1]:>15.4f} {elapsed * 1e3:>16.2f}")
    state_bytes = sum(
        t.numel() * t.element_size() for s in optimizers[1].state.values() for t in s.values()
    )
    where = "pinned host" if device.type == "cuda" else "host"
    print(f"offloaded optimizer state: {state_bytes / 2**20:.2f} MiB in {where} memory")
    return 0
