"""The element-wise rules, AdamW (``torch.optim.AdamW``'s numerics) and Lion (dion's), as
per-unit updates over the engine. A unit is a list of flat segments; the fused kernels (or
their torch references off CUDA) update them in place."""

from __future__ import annotations

from .engine import dispatch
from .engine.algorithm import Algorithm, UnitJob


class AdamWUpdate(Algorithm):
    name = "adamw"
    state_kinds = ("adam_m", "adam_v")

    def update(self, job: UnitJob) -> None:
        h = job.hyper
        if job.quantized:
            dispatch.adamw8_(
                job.backend,
                job.params,
                job.grads,
                *job.state,  # m codes, m scales, v codes, v scales
                lr=h.lr,
                beta1=h.beta1,
                beta2=h.beta2,
                eps=h.eps,
                weight_decay=h.weight_decay,
                step=job.step,
            )
            return
        exp_avgs, exp_avg_sqs = job.state
        dispatch.adamw_(
            job.backend,
            job.params,
            job.grads,
            exp_avgs,
            exp_avg_sqs,
            lr=h.lr,
            beta1=h.beta1,
            beta2=h.beta2,
            eps=h.eps,
            weight_decay=h.weight_decay,
            step=job.step,
        )


class LionUpdate(Algorithm):
    name = "lion"
    state_kinds = ("momentum",)

    def update(self, job: UnitJob) -> None:
        h = job.hyper
        if job.quantized:
            dispatch.lion8_(
                job.backend,
                job.params,
                job.grads,
                *job.state,  # codes, scales
                lr=h.lr,
                beta1=h.beta1,
                beta2=h.beta2,
                weight_decay=h.weight_decay,
            )
            return
        (momentums,) = job.state
        dispatch.lion_(
            job.backend,
            job.params,
            job.grads,
            momentums,
            lr=h.lr,
            beta1=h.beta1,
            beta2=h.beta2,
            weight_decay=h.weight_decay,
        )
