"""muon_offload.AdamW (and Muon's adamw groups) against torch.optim.AdamW over several steps."""

import pytest
import torch

from muon_offload import AdamW, Muon

# Same formula, same fp32 operation order as torch's single-tensor path: measured bitwise equal
# over 5 steps on the CPU (torch 2.13). The tolerance leaves room for torch's fused and foreach
# paths and our Triton kernel, which order the fp32 operations differently (a few roundings).
RTOL, ATOL = 1e-5, 1e-6


def _params(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 19), (1,), (1031,), (3, 5, 7)]
    return [torch.randn(s, generator=gen) for s in shapes]


def _grads(shapes, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) for s in shapes]


def _run(make_opt, init, steps=5, scheduler=None):
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = make_opt(params)
    sched = scheduler(opt) if scheduler else None
    for s in range(steps):
        for p, g in zip(params, _grads([p.shape for p in params], s), strict=True):
            p.grad = g
        opt.step()
        if sched:
            sched.step()
    return params, opt


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3),
        dict(weight_decay=0.0),
    ],
)
def test_adamw_matches_torch(kwargs):
    init = _params(0)
    ours, opt = _run(lambda ps: AdamW(ps, **kwargs), init)
    ref, ref_opt = _run(lambda ps: torch.optim.AdamW(ps, foreach=False, **kwargs), init)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])


def test_adamw_with_scheduler_matches_torch():
    init = _params(1)
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)  # noqa: E731
    ours, _ = _run(lambda ps: AdamW(ps, lr=1e-2), init, scheduler=sched)
    ref, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2), init, scheduler=sched)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_muon_adamw_group_matches_torch():
    init = _params(2)
    ours, _ = _run(
        lambda ps: Muon(
            [dict(params=ps, algorithm="adamw")],
            lr=2e-3,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            epsilon=1e-8,
        ),
        init,
    )
    ref, _ = _run(
        lambda ps: torch.optim.AdamW(ps, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8),
        init,
    )
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
