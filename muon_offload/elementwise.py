"""The element-wise rules, AdamW (``torch.optim.AdamW``'s numerics) and Lion (dion's), as
per-unit updates over the engine. A unit is a list of flat segments; the fused kernels (or
their torch references off CUDA) update them in place. ``job.state`` holds one tensor list a
key for dense state, and codes then scales a key for 8-bit state, in the order the dense and
the 8-bit functions take them."""

from __future__ import annotations

from .engine import dispatch
from .engine.algorithm import Algorithm, UnitJob
from .hyper import Hyper
from .kernels.elementwise import adamw_scalars, lion_scalars


class AdamWUpdate(Algorithm):
    name = "adamw"
    state_kinds = ("adam_m", "adam_v")
    counts_steps = True  # the bias corrections read each parameter's own count

    def scalars(self, hyper: Hyper, step: int, shape=None) -> tuple[float, ...]:
        h = hyper
        return adamw_scalars(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, step)

    def baked(self, hyper: Hyper) -> tuple:
        return (hyper.cautious_wd,)  # the kernels' compile-time flag

    def update(self, job: UnitJob) -> None:
        h = job.hyper
        fn = dispatch.adamw8_ if job.quantized else dispatch.adamw_
        fn(
            job.backend,
            job.params,
            job.grads,
            *job.state,
            lr=h.lr,
            beta1=h.beta1,
            beta2=h.beta2,
            eps=h.eps,
            weight_decay=h.weight_decay,
            step=job.step,
            cautious_wd=h.cautious_wd,
            scalars=job.scalars,
            grad_index=job.grad_index,
        )


class LionUpdate(Algorithm):
    name = "lion"
    state_kinds = ("momentum",)

    def scalars(self, hyper: Hyper, step: int, shape=None) -> tuple[float, ...]:
        return lion_scalars(hyper.lr, hyper.beta1, hyper.beta2, hyper.weight_decay)

    def baked(self, hyper: Hyper) -> tuple:
        return (hyper.cautious_wd,)  # the kernels' compile-time flag

    def update(self, job: UnitJob) -> None:
        h = job.hyper
        fn = dispatch.lion8_ if job.quantized else dispatch.lion_
        fn(
            job.backend,
            job.params,
            job.grads,
            *job.state,
            lr=h.lr,
            beta1=h.beta1,
            beta2=h.beta2,
            weight_decay=h.weight_decay,
            cautious_wd=h.cautious_wd,
            scalars=job.scalars,
            grad_index=job.grad_index,
        )
