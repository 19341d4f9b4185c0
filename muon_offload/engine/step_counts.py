"""Each parameter's step count: how many steps updated it, for AdamW's bias correction.

``torch.optim.AdamW`` counts per parameter (``state[p]["step"]``), and so does dion's Muon for
its adamw groups (``state[p]["step_dev"]``, microsoft/dion at 0a059a4): a parameter whose first
gradient comes late, one that skips steps (gradient None) and one whose state was dropped
(``del opt.state[p]``) start from 1, not from the group's count. Group ``step`` still advances
once a ``step()`` call (dion's, and what our checkpoints carry besides).

The counts live on the host in one float32 tensor, a slot a parameter, read and advanced
through its numpy view, so that a step reads and advances the counts of its thousands of
parameters in a few vectorized passes, never hashing a parameter (``StateIndex`` says why): the
slots of a step's parameters are looked up once per set of parameters (``slots``).
``state_dict()`` hands out each count as a 0-d view of that tensor (float32, as torch's AdamW
keeps ``step``), so a checkpoint loaded in place into a state dict (``dcp.load(opt.state_dict())``,
as torch's optimizers allow) sets the counts the next step reads. Growing the tensor (a parameter
added after the views were handed out) leaves the old views behind: a load into them is refused
at the next read (``check_retired``), not silently lost.

The kernels read their bias corrections from the step's scalar table (``scalars.py``), one row
a unit: so that a unit's parameters share one count, element-wise parameters of different
counts never share a unit (``step_classes``, which the plan's key and the planner's unit key
hold). While every parameter steps, the counts advance together and the classes stay: the plan,
and a CUDA graph captured with it, hold; the table's rows take each step's counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from ..distributed import local

# Where a state dict keeps a parameter's count: torch's AdamW ``step``, dion's ``step_dev``.
COUNT_KEYS = ("step", "step_dev")


class StepCounts:
    """The host counts, a slot a parameter (assigned once, kept while the optimizer lives)."""

    def __init__(self) -> None:
        self._slot: dict[Tensor, int] = {}
        self._live = torch.zeros(0, dtype=torch.float32)  # what state_dict() views
        self.values = self._live.numpy()  # the same memory: whole numbers, exact below 2**24
        # Tensors given up by growth, with their version then: views of them were handed out.
        self._retired: list[tuple[Tensor, int]] = []
        # A step's pairs (``which``) -> their slots, and which of them count steps; and the
        # last step's, compared first by identity (a step that reuses the last one's pairs
        # reuses its ``which``: no hashing a tuple of thousands).
        self._by_work: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._last: tuple[tuple, tuple[np.ndarray, np.ndarray]] | None = None

    def _slot_of(self, p: Tensor) -> int:
        slot = self._slot.get(p)
        if slot is None:
            slot = self._slot[p] = len(self._slot)
            if slot >= self.values.size:
                grown = torch.zeros(max(64, 2 * self.values.size), dtype=torch.float32)
                grown[: self.values.size] = self._live
                if self.values.size:
                    self._retired.append((self._live, self._live._version))
                self._live, self.values = grown, grown.numpy()
        return slot

    def check_retired(self) -> None:
        """Refuse counts written into views that growth left behind (see the module's doc)."""
        if any(t._version != version for t, version in self._retired):
            raise RuntimeError(
                "step counts were loaded into an optimizer state_dict() taken before parameters "
                "were added (add_param_group); take a new state_dict() to load into, or use "
                "load_state_dict()"
            )

    def drop_retired(self) -> None:
        """Every count was set afresh (``load_state_dict``): the old views no longer matter."""
        self._retired.clear()

    def slots(
        self, which: tuple, params: Sequence[Tensor], counted_groups: Sequence[bool]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The slots of a step's parameters (``which``: (group indices, ids) of its pairs, as
        the plan's key names them), and which of them count steps (their group's algorithm
        does: ``counted_groups``, a flag a group)."""
        if self._last is not None and self._last[0] is which:
            return self._last[1]
        found = self._by_work.get(which)
        if found is None:
            slots = np.fromiter(map(self._slot_of, params), dtype=np.int64, count=len(params))
            groups = np.asarray(which[0], dtype=np.int64)
            counted = np.asarray(counted_groups, dtype=bool)[groups]
            found = self._by_work[which] = (slots, counted)
        self._last = (which, found)
        return found

    def for_step(
        self, which: tuple, params: Sequence[Tensor], counted_groups: Sequence[bool]
    ) -> tuple[np.ndarray, np.ndarray, tuple[int, ...] | None]:
        """For a step's parameters (``slots``' arguments): their slots, their counts with this
        step (int64), and their classes (``step_classes``)."""
        slots, counted = self.slots(which, params, counted_groups)
        if self._retired:
            self.check_retired()
        counts = self.values[slots].astype(np.int64) + 1
        return slots, counts, step_classes(counts, counted)

    def advance(self, slots: np.ndarray, counts: np.ndarray) -> Callable[[Sequence[int]], None]:
        """Set the step's counts (``for_step``'s); return what an interrupted step calls with
        the items (indices into ``slots``) it did not update, to take their counts back."""
        self.values[slots] = counts

        def step_back(items: Sequence[int]) -> None:
            self.values[slots[list(items)]] -= 1

        return step_back

    def get(self, p: Tensor) -> int:
        slot = self._slot_of(p)
        if self._retired:
            self.check_retired()
        return int(self.values[slot])

    def tensor(self, p: Tensor) -> Tensor:
        """``p``'s count as a live 0-d float32 tensor on the CPU (what ``state_dict()`` holds):
        a write into it is the count the next step reads."""
        slot = self._slot_of(p)  # first: it may grow ``_live``
        return self._live[slot]

    def set(self, p: Tensor, count: int) -> None:
        slot = self._slot_of(p)  # first: it may grow ``values``
        self.values[slot] = count

    def reset(self, params: Iterable[Tensor]) -> None:
        """State created afresh: its parameters have stepped 0 times."""
        for p in params:
            self.set(p, 0)


def step_classes(counts: np.ndarray, counted: np.ndarray) -> tuple[int, ...] | None:
    """Each work item's class: equal for items of equal count among the ``counted`` ones (whose
    algorithm reads a count), 0 for the others; None when all counted items are equal (the
    usual case: one class). Classes are ranks of the distinct counts, so they name the
    partition and order, not the counts: a parameter that skips steps now and then keeps its
    class, and the plans cached stay few."""
    mine = counts[counted]
    if mine.size == 0 or mine.min() == mine.max():
        return None
    classes = np.zeros(counts.size, dtype=np.int64)
    classes[counted] = np.unique(mine, return_inverse=True)[1]
    return tuple(classes.tolist())


def split_by_count(infos: list, classes: tuple[int, ...] | None) -> list:
    """The planner's ``ParamInfo``s with each one's step class in its unit key, so that no
    unit holds parameters of two counts (``classes``: ``step_classes``; None: one count)."""
    if classes is None:
        return infos
    return [replace(f, unit_key=(f.unit_key, c)) for f, c in zip(infos, classes, strict=True)]


def saved_count(values: Mapping, where: str) -> int | None:
    """The count a saved parameter state holds (torch's ``step``, dion's ``step_dev``: a tensor
    of one element or a number), checked; None when it holds none."""
    for key in COUNT_KEYS:
        if key not in values:
            continue
        value = values[key]
        if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
            value = local(value).item()
        elif isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
            value = int(local(value).item())
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
            or value != int(value)
        ):
            raise ValueError(
                f"{where}: loaded {key!r} is {value!r}; expected a whole number of steps >= 0"
            )
        return int(value)
    return None


def loaded_counts(
    param_groups: list[dict],
    saved_groups: list[dict],
    saved_state: Mapping,
    counted: Sequence[bool],
) -> dict[Tensor, int]:
    """Each live parameter's count after a load, for the groups that count steps (``counted``,
    a flag a group): its saved ``step`` or ``step_dev``, else its saved group's ``step`` (a
    checkpoint that counts per group), and 0 where the checkpoint holds no state for it (its
    state is zeroed). Checked, before anything is written."""
    out: dict[Tensor, int] = {}
    for gi, (ours, saved) in enumerate(zip(param_groups, saved_groups, strict=True)):
        if not counted[gi]:
            continue
        group_count = saved_count({"step": saved.get("step", 0)}, f"param group {gi}")
        for saved_id, p in zip(saved["params"], ours["params"], strict=True):
            values = saved_state.get(saved_id)
            if values is None:
                out[p] = 0
                continue
            count = saved_count(values, f"param group {gi} (parameter of shape {tuple(p.shape)})")
            out[p] = group_count if count is None else count
    return out
