"""State assigned by the user between steps: ``opt.state[p] = {...}`` or
``opt.state[p]["momentum"] = t``, as torch's optimizers allow.

The engine plans a step from the tensors it made for each parameter's state (``held``): a
resident chunk's layouts hold them, a streamed chunk's transfers hold their host slab bytes.
A tensor assigned in their place must be what the next step updates, so before each step:

- resident state: the assigned tensor is adopted (the step updates it in place, as torch's
  optimizers would) when it is a plain contiguous tensor on the held one's device; otherwise
  its values are copied into the held tensor, which goes back into the dict;
- streamed state (pinned host slabs): the values are copied into the held slab tensor once the
  last step's write-backs have landed, and the slab tensor goes back into the dict: streamed
  state lives in the slabs, so ``opt.state[p][name]`` is the slab tensor again after the step.

Either way the cached plans are dropped (their layouts and transfers named the old tensors).
A value of another shape or dtype, a missing name or a non-tensor is refused before anything
is written, with how to start that parameter's state afresh instead.

The check costs one C-level pass over the step's state values while nothing was assigned:
the values seen at the last check are compared by identity (``same_objects``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain

from torch import Tensor

from ..distributed import DTensor, local
from .step_work import same_objects


class HeldState:
    """The tensors the engine made for each parameter's state, and the state values seen at
    the last check that found every one of them in place."""

    def __init__(self) -> None:
        self.tensors: dict[Tensor, dict[str, Tensor]] = {}
        self._verified: tuple | None = None

    def keep(self, param: Tensor, tensors: dict[str, Tensor]) -> None:
        self.tensors[param] = dict(tensors)
        self._verified = None

    def forget(self, params) -> None:
        for p in params:
            self.tensors.pop(p, None)
        self._verified = None

    def adopt(
        self,
        dicts: Sequence[dict | None],
        params: Sequence[Tensor],
        streamed: set[Tensor],
        synchronize: Callable[[], None],
    ) -> bool:
        """Make each stepped parameter's state dict hold tensors the step may update (the
        module docstring says how); True when anything was adopted or copied, so the caller
        drops its plans. ``dicts``: the state dicts of ``params`` (None where absent)."""
        values = tuple(chain.from_iterable(d.values() for d in dicts if d))
        if self._verified is not None and same_objects(values, self._verified):
            return False
        changes = []
        for p, d in zip(params, dicts, strict=True):
            held = self.tensors.get(p)
            if not d or held is None:
                continue  # no state yet: created this step
            for name, tensor in held.items():
                value = d.get(name)
                if value is not tensor:
                    changes.append((p, d, name, tensor, _checked(p, name, value, tensor)))
        if changes:
            if any(p in streamed for p, *_ in changes):
                synchronize()  # no write-back may land after the values are copied in
            for p, d, name, tensor, value in changes:
                if p not in streamed and _adoptable(value, tensor):
                    self.tensors[p][name] = value
                else:
                    local(tensor).copy_(local(value))
                    d[name] = tensor
            values = tuple(chain.from_iterable(d.values() for d in dicts if d))
        self._verified = values
        return bool(changes)


def _checked(param: Tensor, name: str, value, held: Tensor) -> Tensor:
    where = f"opt.state[param][{name!r}] (parameter of shape {tuple(param.shape)})"
    fresh = "to start its state afresh, del opt.state[param] before step()"
    if value is None:
        raise ValueError(f"{where} is missing; {fresh}")
    if not isinstance(value, Tensor):
        raise ValueError(f"{where} is a {type(value).__name__}, not a tensor; {fresh}")
    if value.shape != held.shape or value.dtype != held.dtype:
        raise ValueError(
            f"{where} was assigned a {value.dtype} tensor of shape {tuple(value.shape)}; the "
            f"step needs {held.dtype} of shape {tuple(held.shape)} (8-bit state: the codes "
            f"and scales as state_dict() gives them, or load_state_dict); {fresh}"
        )
    if isinstance(value, DTensor) != isinstance(held, DTensor):
        raise ValueError(f"{where}: a DTensor parameter's state is a DTensor like it; {fresh}")
    return value


def _adoptable(value: Tensor, held: Tensor) -> bool:
    """Whether resident state may be the assigned tensor itself: on the held one's device,
    laid out as the kernels read it, owning its memory (no view that another tensor, perhaps
    another parameter's state, shares) and outside autograd (the update is in place)."""
    v = local(value)
    return (
        not isinstance(value, DTensor)
        and v.device == local(held).device
        and v.is_contiguous()
        and v.storage_offset() == 0
        and v.untyped_storage().nbytes() == v.numel() * v.element_size()
        and not v.requires_grad
    )
