"""``AdamW``: ``torch.optim.AdamW``'s numerics and constructor on the chunked, optionally
offloaded, engine. State keys are torch's (``exp_avg``, ``exp_avg_sq``)."""

from __future__ import annotations

import torch

from .elementwise import AdamWUpdate
from .engine import ChunkedOptimizer
from .hyper import Hyper, read_torch_adamw_hyper


class AdamW(ChunkedOptimizer):
    """AdamW with decoupled weight decay and bias correction.

    Takes ``torch.optim.AdamW``'s arguments; ``amsgrad``, ``maximize`` and ``differentiable``
    must stay False, and ``foreach``, ``capturable`` and ``fused`` are accepted and ignored
    (the update is always one fused kernel per chunk). The bias-correction step is the
    group's ``step``, which advances once per ``step()`` call. ``offload``, ``chunk_bytes``,
    ``resident_bytes``, ``resident_chunk_bytes``, ``state_dtype`` and ``backend`` are as for
    ``Muon``.
    """

    algorithms = {"adamw": AdamWUpdate(("exp_avg", "exp_avg_sq"))}

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        offload: bool = False,
        chunk_bytes: int | None = None,
        resident_bytes: int | None = 0,
        resident_chunk_bytes: int | None = None,
        state_dtype: torch.dtype | None = None,
        backend: str = "auto",
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            algorithm="adamw",
            step=0,
        )
        super().__init__(
            params,
            defaults,
            offload=offload,
            chunk_bytes=chunk_bytes,
            resident_bytes=resident_bytes,
            resident_chunk_bytes=resident_chunk_bytes,
            state_dtype=state_dtype,
            backend=backend,
        )

    def _read_hyper(self, group: dict, index: int) -> Hyper:
        if group.get("algorithm", "adamw") != "adamw":
            raise ValueError(
                f"param group {index}: AdamW groups take no other algorithm, "
                f"got {group['algorithm']!r}"
            )
        return read_torch_adamw_hyper(group, index)
