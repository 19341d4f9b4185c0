"""What an interrupted ``step()`` leaves behind, said precisely.

The engine runs a step chunk by chunk and unit by unit. When an exception stops it, every
finished unit keeps its update (streamed chunks write the finished units' state back), every
other unit keeps its weights and state as before the step (streamed state falls back to the
untouched host copy). This module turns the record of finished units into the error a user
sees.
"""

from __future__ import annotations

from torch import Tensor

from .planner import MuonUnit, unit_params


class StepInterrupted(RuntimeError):
    """``step()`` stopped part-way. ``updated`` lists the parameters whose update (weights
    and state) was applied, ``not_updated`` those left exactly as before the step,
    ``partial`` element-wise parameters split across chunks and updated in part (each element
    consistently), ``torn`` resident parameters whose momentum may have advanced without
    their weight update."""

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


def interrupted(plan, work, finished, err, param_groups) -> StepInterrupted:
    """Say which parameters an interrupted step updated, and roll the step counter back
    for groups that saw no update at all. ``finished[i]`` lists the units of chunk i that
    completed; ``work`` is the step's (group index, parameter) list."""
    updated, pending, torn = set(), set(), set()
    for chunk, done in zip(plan.chunks, finished, strict=True):
        for k, unit in enumerate(chunk.units):
            (updated if k in done else pending).update(unit_params(unit))
    failed = next((i for i, c in enumerate(plan.chunks) if len(finished[i]) < len(c.units)), None)
    if failed is not None and plan.chunks[failed].resident:
        # Resident state is updated in place, with no copy to fall back to: a Muon unit
        # stopped between its momentum update and its weight update keeps the advanced
        # momentum. Streamed units always fall back to the host copy.
        chunk = plan.chunks[failed]
        muon = [k for k, u in enumerate(chunk.units) if isinstance(u, MuonUnit)]
        stopped = [k for k in muon if k not in finished[failed]]
        if stopped:
            torn.update(unit_params(chunk.units[stopped[0]]))
    partial = updated & pending  # element-wise parameters split across chunks
    updated -= partial
    pending -= partial
    stepped_groups = {work[i][0] for i in updated | partial}
    for gi, group in enumerate(param_groups):
        if gi not in stepped_groups:
            group["step"] -= 1

    def shapes(ids):
        return sorted({tuple(work[i][1].shape) for i in ids})

    message = (
        f"step() was interrupted ({type(err).__name__}: {err}). {len(updated)} parameters "
        f"were updated (weights and state), {len(pending)} were not (weights and state as "
        f"before the step; shapes {shapes(pending)[:6]})."
    )
    if partial:
        message += (
            f" {len(partial)} element-wise parameters split across chunks (shapes "
            f"{shapes(partial)[:6]}) were updated in part: each element's weight and state "
            "are together either updated or as before."
        )
    if torn:
        message += (
            f" {len(torn)} resident parameters (shapes {shapes(torn)[:6]}) may have their "
            "momentum advanced without the weight update."
        )
    return StepInterrupted(
        message + " The next step() updates every parameter that has a gradient.",
        updated=[work[i][1] for i in sorted(updated)],
        not_updated=[work[i][1] for i in sorted(pending)],
        partial=[work[i][1] for i in sorted(partial)],
        torn=[work[i][1] for i in sorted(torn)],
    )
