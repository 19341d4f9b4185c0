"""bench/train_compare.py's modes (optimizer and state format), hyper-parameters, learning-rate
schedule and the two presets' sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from muon_offload import AdamW, Muon

# isort: split
from train_compare_model import GPT, adamw_groups, muon_groups

# Muon: dion's defaults (mu 0.95, no nesterov, adjust_lr "spectral_norm", weight decay 0.01)
# with lr 0.02; its AdamW group (embeddings, head, norms) at 3e-3 without weight decay.
# AdamW alone: lr 1e-3, weight decay 0.1 on the matrices. Linear warmup over the first 5% of
# the steps, then cosine down to 10% of the peak; gradients clipped to norm 1.
HYPER = dict(
    muon_lr=0.02,
    muon_mu=0.95,
    muon_wd=0.01,
    muon_adamw_lr=3e-3,
    adamw_lr=1e-3,
    adamw_wd=0.1,
    betas=(0.9, 0.95),
    clip=1.0,
    warmup_fraction=0.05,
    lr_floor=0.1,
)


@dataclass(frozen=True)
class Mode:
    name: str
    optimizer: str  # "muon" or "adamw"; the ratio is to f"{optimizer}_fp32"
    state_dtype: torch.dtype
    gram: bool = False


MODES = {
    m.name: m
    for m in (
        Mode("muon_fp32", "muon", torch.float32),
        Mode("muon_bf16", "muon", torch.bfloat16),
        Mode("muon_int8", "muon", torch.int8),
        Mode("muon_gram_fp32", "muon", torch.float32, gram=True),
        Mode("adamw_fp32", "adamw", torch.float32),
        Mode("adamw_bf16", "adamw", torch.bfloat16),
        Mode("adamw_int8", "adamw", torch.int8),
    )
}
# Run order: 8-bit against fp32 state first, so a run cut short still answers that.
DEFAULT_MODES = (
    "muon_fp32",
    "muon_int8",
    "adamw_fp32",
    "adamw_int8",
    "muon_bf16",
    "adamw_bf16",
    "muon_gram_fp32",
)
FULL = dict(
    steps=2000,
    batch=24,
    seq=512,
    dim=640,
    layers=11,
    heads=10,
    eval_every=200,
    val_batches=8,
    final_window=100,
    log_every=50,
)
TINY = dict(
    steps=30,
    batch=8,
    seq=64,
    dim=64,
    layers=2,
    heads=4,
    eval_every=10,
    val_batches=2,
    final_window=10,
    log_every=10,
)


def describe(mode: Mode) -> dict:
    return {"optimizer": mode.optimizer, "state_dtype": str(mode.state_dtype), "gram": mode.gram}


def build_optimizer(mode: Mode, model: GPT, offload: bool):
    common = dict(offload=offload, state_dtype=mode.state_dtype)
    if mode.optimizer == "muon":
        kwargs = dict(use_gram_newton_schulz=True) if mode.gram else {}
        groups = muon_groups(model, HYPER["muon_adamw_lr"])
        muon_hyper = dict(mu=HYPER["muon_mu"], betas=HYPER["betas"], weight_decay=HYPER["muon_wd"])
        return Muon(groups, lr=HYPER["muon_lr"], **muon_hyper, **kwargs, **common)
    groups = adamw_groups(model, HYPER["adamw_wd"])
    return AdamW(groups, lr=HYPER["adamw_lr"], betas=HYPER["betas"], **common)


def lr_factor(step: int, steps: int) -> float:
    warmup, floor = max(1, round(HYPER["warmup_fraction"] * steps)), HYPER["lr_floor"]
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
