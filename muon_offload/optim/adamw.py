"""``AdamW``: ``torch.optim.AdamW``'s numerics and constructor on the chunked, optionally
offloaded, engine. State keys are torch's (``exp_avg``, ``exp_avg_sq``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..engine import ChunkedOptimizer
from ..engine.algorithm import Hyper
from ..engine.settings import takes_settings
from .elementwise import AdamWUpdate
from .hyper import read_torch_adamw_hyper, torch_betas

if TYPE_CHECKING:  # typing_extensions (a torch dependency): Unpack on Python 3.10
    from typing_extensions import Unpack

    from ..engine.settings import SettingsArgs


@takes_settings
class AdamW(ChunkedOptimizer):
    """AdamW with decoupled weight decay and bias correction.

    Takes ``torch.optim.AdamW``'s arguments; ``amsgrad``, ``maximize`` and ``differentiable``
    must stay False, and ``foreach``, ``capturable`` and ``fused`` are accepted and ignored
    (the update is always one fused kernel per chunk). The bias correction reads each
    parameter's own step count, as torch's: the steps that updated it (a parameter whose
    gradient is None is not updated; ``del opt.state[p]`` starts it afresh); the group's
    ``step`` counts ``step()`` calls. Under a captured step (``cuda_graph``) the bias correction
    and learning rate still change every step.

    Checkpoints go both ways with ``torch.optim.AdamW``: ``state_dict()`` carries torch's
    per-parameter ``step`` (a float32 tensor) and ``load_state_dict`` reads it; a torch state
    dict (no group ``step``) sets each group's ``step`` to the largest of its parameters'.
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
        **settings: Unpack[SettingsArgs],  # the engine's (SETTINGS_DOC, Settings.check)
    ):
        defaults = dict(
            lr=lr,
            betas=torch_betas(betas),
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
        super().__init__(params, defaults, **settings)

    def _read_hyper(self, group: dict, index: int) -> Hyper:
        if group.get("algorithm", "adamw") != "adamw":
            raise ValueError(
                f"param group {index}: AdamW groups take no other algorithm, "
                f"got {group['algorithm']!r}"
            )
        return read_torch_adamw_hyper(group, index)

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if isinstance(groups, list) and any(
            isinstance(g, dict) and "step" not in g for g in groups
        ):
            state_dict = {**state_dict, "param_groups": _group_steps_from_torch(state_dict)}
        super().load_state_dict(state_dict)


def _group_steps_from_torch(state_dict: dict) -> list[dict]:
    """torch's AdamW keeps ``step`` per parameter only; our groups count ``step()`` calls
    besides: each group takes the largest of its parameters' (0 where none has state yet).
    The parameters' own counts are loaded as they are (``engine/step_counts.py``)."""
    state = state_dict.get("state", {})
    out = []
    for group in state_dict["param_groups"]:
        if not isinstance(group, dict) or "step" in group:
            out.append(group)
            continue
        steps = set()
        for i in group.get("params", ()):
            step = state.get(i, {}).get("step") if isinstance(state.get(i), dict) else None
            if step is not None:
                steps.add(int(step.item() if isinstance(step, torch.Tensor) else step))
        out.append({**group, "step": max(steps, default=0)})
    return out
