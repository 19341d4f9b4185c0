"""The element-wise rules, AdamW (``torch.optim.AdamW``'s numerics) and Lion (dion's), as
per-unit updates over the engine, and their launchers. A unit is a list of flat segments; the
fused kernels (or their torch references off CUDA) update them in place. ``job.state`` holds one
tensor list a key for dense state, and codes then scales a key for 8-bit state, in the order the
dense and the 8-bit launchers take them: each update picks one by the kernel family its state
format declares (``_pick``); state of other formats reaches them decoded to fp32
(``Algorithm.run``)."""

from __future__ import annotations

from ..engine.algorithm import Algorithm, Hyper, UnitJob, runs_triton
from ..kernels import elementwise, elementwise_reference
from ..kernels.elementwise import adamw_scalars, lion_scalars


class AdamWUpdate(Algorithm):
    name = "adamw"
    state_kinds = ("adam_m", "adam_v")
    counts_steps = True  # the bias corrections read each parameter's own count
    kernels = ("dense", "int8")

    def scalars(self, hyper: Hyper, step: int, shape=None) -> tuple[float, ...]:
        h = hyper
        return adamw_scalars(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, step)

    def baked(self, hyper: Hyper) -> tuple:
        return (hyper.cautious_wd,)  # the kernels' compile-time flag

    def update(self, job: UnitJob) -> None:
        h = job.hyper
        launch = _pick(job, adamw_, adamw8_)
        numbers = dict(lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, step=job.step)
        _launch_unit(job, launch, weight_decay=h.weight_decay, **numbers)


class LionUpdate(Algorithm):
    name = "lion"
    state_kinds = ("momentum",)
    kernels = ("dense", "int8")

    def scalars(self, hyper: Hyper, step: int, shape=None) -> tuple[float, ...]:
        return lion_scalars(hyper.lr, hyper.beta1, hyper.beta2, hyper.weight_decay)

    def baked(self, hyper: Hyper) -> tuple:
        return (hyper.cautious_wd,)  # the kernels' compile-time flag

    def update(self, job: UnitJob) -> None:
        h = job.hyper
        launch = _pick(job, lion_, lion8_)
        numbers = dict(lr=h.lr, beta1=h.beta1, beta2=h.beta2)
        _launch_unit(job, launch, weight_decay=h.weight_decay, **numbers)


def _pick(job: UnitJob, dense, int8):
    """The launcher of the unit's state format's kernel family (``Algorithm.kernels``)."""
    return int8 if job.fmt.kernels == "int8" else dense


def _launch_unit(job: UnitJob, launch, **numbers) -> None:
    """``launch`` (the dense or the 8-bit launcher, by the unit's state format) on the unit,
    with the rule's numbers (the torch references' and a direct call's) and its tables."""
    h = job.hyper
    launch(
        job.backend,
        job.params,
        job.grads,
        *job.state,
        **numbers,
        cautious_wd=h.cautious_wd,
        scalars=job.scalars,
        grad_index=job.grad_index,
    )


# The launchers. ``scalars``: the unit's row of the step's scalar table (``engine/scalars.py``),
# which the kernels read on the device; without it (a direct call) the kernels take the
# numbers. The torch references always take the numbers. ``grad_index``: where the kernels read
# the gradients' addresses (the step's gradient table, ``engine/grad_table.py``), None for the
# gradients' own; taken with ``scalars`` only. ``cautious_wd``: a compile-time flag of the
# kernels, so it goes with the table too.
def _launch(backend, kernels, params, grads, state, scalars, grad_index, hyper) -> None:
    """``kernels``: (the torch reference, the kernel reading the tables, the kernel taking
    the numbers)."""
    reference, from_tables, from_numbers = kernels
    if not runs_triton(backend, params[0].device):
        reference(params, grads, *state, **hyper)
    elif scalars is not None:
        cautious = hyper.get("cautious_wd", False)
        from_tables(params, grads, *state, scalars, grad_index, cautious)
    else:
        from_numbers(params, grads, *state, **hyper)


def adamw_(
    backend: str, params, grads, exp_avgs, exp_avg_sqs, *, scalars=None, grad_index=None, **hyper
) -> None:
    kernels = (elementwise_reference.adamw_reference_, elementwise.adamw_from_, elementwise.adamw_)
    state = (exp_avgs, exp_avg_sqs)
    _launch(backend, kernels, params, grads, state, scalars, grad_index, hyper)


def lion_(backend: str, params, grads, exp_avgs, *, scalars=None, grad_index=None, **hyper) -> None:
    kernels = (elementwise_reference.lion_reference_, elementwise.lion_from_, elementwise.lion_)
    _launch(backend, kernels, params, grads, (exp_avgs,), scalars, grad_index, hyper)


# 8-bit state (kernels/quantized_elementwise.py), imported where it is used: a dense optimizer
# never loads it. Chosen as the dense kernels are: the kernels on CUDA (H200, triton 3.6,
# 2026-12-01: equal to the references bit for bit on the GPU, offloaded and resident 8-bit
# steps the same bits; docs/benchmarks.md), the references elsewhere.
def adamw8_(
    backend: str,
    params,
    grads,
    m_codes,
    m_scales,
    v_codes,
    v_scales,
    *,
    scalars=None,
    grad_index=None,
    **hyper,
) -> None:
    from ..kernels import quantized_elementwise as q
    from ..kernels import quantized_elementwise_reference as r

    kernels = (r.adamw8_reference_, q.adamw8_from_, q.adamw8_)
    state = (m_codes, m_scales, v_codes, v_scales)
    _launch(backend, kernels, params, grads, state, scalars, grad_index, hyper)


def lion8_(
    backend: str, params, grads, m_codes, m_scales, *, scalars=None, grad_index=None, **hyper
) -> None:
    from ..kernels import quantized_elementwise as q
    from ..kernels import quantized_elementwise_reference as r

    kernels = (r.lion8_reference_, q.lion8_from_, q.lion8_)
    _launch(backend, kernels, params, grads, (m_codes, m_scales), scalars, grad_index, hyper)
