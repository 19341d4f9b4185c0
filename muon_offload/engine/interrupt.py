"""What an interrupted ``step()`` leaves behind, said precisely.

The engine runs a step chunk by chunk and unit by unit. When an exception stops it, every
finished unit keeps its update (streamed chunks write the finished units' state back), every
unit that had not started keeps its weights and state as before the step (streamed state falls
back to the untouched host copy). A unit that had started and not finished may be part-way:
weights are updated in place (a kernel per dtype, a Muon unit's momentum before its weights),
so it is reported as ``torn``, never as "as before". This module turns the record of started
and finished units into the error a user sees.

A ``KeyboardInterrupt`` (or another ``BaseException`` that is not an ``Exception``) stays what
it is, so that ``except Exception`` in a training loop does not swallow it: the bookkeeping is
the same, and the report rides on it as ``.step_interrupted`` (and a note).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from .planner import unit_params


class StepInterrupted(RuntimeError):
    """``step()`` stopped part-way. ``updated`` lists the parameters whose update (weights
    and state) was applied, ``not_updated`` those left exactly as before the step,
    ``partial`` parameters cut across chunks (element-wise ones, Muon stacks) and updated in
    part (each element, each matrix, consistently), ``torn`` parameters whose unit stopped
    part-way: weights or state may be partly updated."""

    def __init__(
        self,
        message: str,
        *,
        updated: list[Tensor],
        not_updated: list[Tensor],
        partial: list[Tensor],
        torn: list[Tensor],
    ):
        super().__init__(message)
        self.updated = updated
        self.not_updated = not_updated
        self.partial = partial
        self.torn = torn


def interrupted(
    plan, work, progress, err, param_groups, step_back: Callable[[list[int]], None]
) -> StepInterrupted:
    """Say which parameters an interrupted step updated, and roll the step counts back: each
    group's for groups that saw no update at all, and each parameter's (``step_counts.py``)
    for parameters not updated, or torn (their unit may not have touched them: the common
    case), by ``step_back`` (given their indices into ``work``). A parameter updated in part
    keeps its new count: its updated elements' state has seen the step. ``progress[i]`` is
    (started, finished) unit indices of chunk i; ``work`` is the step's (group index,
    parameter) list."""
    updated, pending, torn = set(), set(), set()
    for chunk, (started, done) in zip(plan.chunks, progress, strict=True):
        for k, unit in enumerate(chunk.units):
            if k in done:
                updated.update(unit_params(unit))
            elif k in started:
                torn.update(unit_params(unit))
            else:
                pending.update(unit_params(unit))
    pending -= torn
    updated -= torn
    partial = updated & pending  # parameters cut across chunks (element-wise, Muon stacks)
    updated -= partial
    pending -= partial
    # A torn unit alone does not count: it may not have touched anything (the common case
    # of an interrupt), and its parameters are named in the error either way.
    stepped_groups = {work[i][0] for i in updated | partial}
    for gi, group in enumerate(param_groups):
        if gi not in stepped_groups:
            group["step"] -= 1
    step_back(sorted(pending | torn))

    def shapes(ids):
        return sorted({tuple(work[i][1].shape) for i in ids})

    message = (
        f"step() was interrupted ({type(err).__name__}: {err}). {len(updated)} parameters "
        f"were updated (weights and state), {len(pending)} were not (weights and state as "
        f"before the step; shapes {shapes(pending)[:6]})."
    )
    if partial:
        message += (
            f" {len(partial)} parameters cut across chunks (shapes {shapes(partial)[:6]}) "
            "were updated in part: each element's (a Muon stack: each matrix's) weight and "
            "state are together either updated or as before."
        )
    if torn:
        message += (
            f" {len(torn)} parameters (shapes {shapes(torn)[:6]}) were being updated when it "
            "stopped: their weights and state may be partly updated."
        )
    return StepInterrupted(
        message + " The next step() updates every parameter that has a gradient.",
        updated=[work[i][1] for i in sorted(updated)],
        not_updated=[work[i][1] for i in sorted(pending)],
        partial=[work[i][1] for i in sorted(partial)],
        torn=[work[i][1] for i in sorted(torn)],
    )
