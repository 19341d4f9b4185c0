"""Checkpoints: ``state_dict`` / ``load_state_dict`` into the engine's existing state
tensors, and copies of an optimizer (``copy.deepcopy``, ``pickle``, ``torch.save(opt)``).

Everything is checked before anything is written: a state dict that does not fit raises
``ValueError`` with the optimizer exactly as it was (8-bit state included: codes of each state
kind's dtype, scales of the layout the loaded groups give, in the live state as in the loaded
one; each format names, checks and converts its own tensors: ``state_format.py``). Host slabs
stay where they are; loaded values are copied into them (or into resident state), converting
dtype, device and format. Each parameter's step count (``step_counts.py``) is saved
beside its state, under torch's AdamW key ``step`` or dion's ``step_dev``, and loaded from
either (from the group's ``step`` where a checkpoint has neither, as dion loads).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
from torch import Tensor

from ..distributed import DTensor, local, resolve_mesh
from . import capture_rules
from .algorithm import Hyper
from .saved_groups import carried, check_groups, check_structure, listed_keys, names_no_parameter
from .sharded_scales import crop, lay_out, strip_rank_dims
from .state import group_pairs, key_shapes
from .state_format import Dense, StateFormat, StatePolicy
from .step_counts import loaded_counts

# State may arrive in any of the dtypes our, dion's or torch's optimizers keep it in; others
# (fp64, integers, complex) are not optimizer state of these algorithms.
LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# A loaded key: its format and tensors (one dense; codes and scales for 8-bit), local.
Entry = tuple[StateFormat, tuple[Tensor, ...]]


def check_state(
    param_groups: list[dict],
    saved_groups: list[dict],
    saved_state: Mapping,
    hypers: Sequence[Hyper],
    algorithms: dict,
    formats: Callable[[Tensor], Sequence[StateFormat]],
    matrices: Callable[[int, Tensor], int] | None = None,
) -> dict[Tensor, dict[str, Entry]]:
    """Map each saved entry to its live parameter and check it holds every state key of its
    group's algorithm: dense (``key``: the parameter's shape, a floating dtype) or one of
    ``formats(p)`` (its ``names(key)``, the first in the parameter's shape, of the dtypes the
    format accepts; side tensors, such as 8-bit scales, of the shape the format gives this
    rank's shard with ``matrices(group, p)`` matrices under the loaded groups, cut out of their
    rank-major row for a DTensor parameter, sharded_scales.py).
    Returns live parameter -> {key: (its format, its tensors)}, local tensors."""
    owner = {
        saved_id: (gi, p)
        for gi, (ours, saved) in enumerate(zip(param_groups, saved_groups, strict=True))
        for saved_id, p in zip(saved["params"], ours["params"], strict=True)
    }
    loaded: dict[Tensor, dict[str, Entry]] = {}
    listed = listed_keys(saved_groups)
    for saved_id, values in saved_state.items():
        if names_no_parameter(saved_id, listed):  # a hook's own (``carried``)
            continue
        if saved_id not in owner:
            raise ValueError(f"loaded state names parameter {saved_id!r}, which no group lists")
        gi, p = owner[saved_id]
        where = f"param group {gi} (parameter of shape {tuple(p.shape)})"
        count = matrices(gi, p) if matrices else None
        algorithm = algorithms[hypers[gi].algorithm]
        loaded[p] = {
            key: _checked_entry(values, key, kind, p, where, formats(p), count, shapes)
            for key, kind, shapes in key_shapes(algorithm, p)
        }
    return loaded


def _entry_format(values: Mapping, key: str, kind: str, formats, where: str) -> StateFormat:
    """The first of ``formats`` whose tensors of ``key`` the entry holds and that accepts them
    (else the first one's complaint), or dense."""
    refused = None
    for fmt in formats:
        tensors = tuple(values.get(name) for name in fmt.names(key))
        if not all(isinstance(t, Tensor) for t in tensors):
            continue
        try:
            fmt.accepts(tensors, key, kind, where)
            return fmt
        except ValueError as e:
            refused = refused or e
    if refused is not None:
        raise refused
    value = values.get(key)
    if not isinstance(value, Tensor):
        raise ValueError(f"{where}: loaded state {key!r} is missing")
    if value.dtype not in LOADABLE_DTYPES:
        raise ValueError(
            f"{where}: loaded state {key!r} is {value.dtype}; expected one of {LOADABLE_DTYPES}"
        )
    return Dense(value.dtype)


def _checked_entry(
    values: Mapping,
    key: str,
    kind: str,
    p: Tensor,
    where: str,
    formats: Sequence[StateFormat],
    matrices: int | None = None,
    shapes: tuple[torch.Size, torch.Size] | None = None,
) -> Entry:
    """``shapes``: the key's (global, local) shape by its algorithm (``key_shapes``); None:
    the parameter's."""
    fmt = _entry_format(values, key, kind, formats, where)
    names = fmt.names(key)
    tensors = tuple(values[name] for name in names)
    first = tensors[0]
    whole, mine = shapes if shapes is not None else (p.shape, local(p).shape)
    if tuple(first.shape) != tuple(whole) or local(first).shape != mine:
        theirs = "the parameter's" if tuple(whole) == tuple(p.shape) else f"{tuple(whole)}"
        raise ValueError(
            f"{where}: loaded state {key!r} has shape {tuple(first.shape)}, not {theirs}"
        )
    expected = {}
    if matrices is not None:
        count = matrices if mine == local(p).shape else 1
        expected = {n: shape for n, shape, _ in fmt.specs(key, mine, kind, count)}
    out = []
    for name, t in zip(names, tensors, strict=True):
        if not fmt.is_side(name):
            out.append(local(t))
            continue
        # A sharded parameter's side tensors come rank-major (sharded_scales.py).
        t = strip_rank_dims(t, f"{where}, {key!r}")
        if name in expected:
            if isinstance(p, DTensor):
                t = crop(t, expected[name], f"{where}, {key!r}")
            if tuple(t.shape) != tuple(expected[name]):
                raise ValueError(
                    f"{where}: loaded {fmt.label} scales of {key!r} have shape "
                    f"{tuple(t.shape)}, not {tuple(expected[name])} (one a block of "
                    f"{fmt.block} elements, a row a matrix of a stack unless the group "
                    "flattens it): truncated, or saved from another layout"
                )
        out.append(t)
    return fmt, tuple(out)


def check_live_layout(states, state: dict, groups, hypers: Sequence[Hyper]) -> list[Tensor]:
    """The live side tensors (8-bit scales) must be laid out as the loaded groups lay them
    out: a load that changes a group's ``flatten`` cannot re-cut the blocks of a stack whose
    8-bit state holds values. State as created (no step or load since:
    ``StateStore.pristine``) is made afresh instead, as if it did not exist yet: returned,
    those parameters. ``states``: the optimizer's ``StateBuilder``; ``state`` and ``groups``:
    its live state and param groups."""
    afresh = []
    for gi, p in group_pairs(groups):
        fmt, values = states.store.formats.get(p), state.get(p, {})
        if fmt is None:
            continue
        algorithm = states.algorithms[hypers[gi].algorithm]
        count = loaded_matrices(states.algorithms, hypers[gi], p)
        shape = local(p).shape
        specs = StatePolicy.specs(fmt, shape, algorithm.state_shapes(shape), count)
        for name, shape, _ in specs:
            t = values.get(name)
            if not fmt.is_side(name) or t is None or local(t).shape == shape:
                continue
            if p in states.store.pristine:
                afresh.append(p)
                break
            raise ValueError(
                f"param group {gi} (parameter of shape {tuple(p.shape)}): its {fmt.label} "
                f"state has scales of shape {tuple(local(t).shape)}, the loaded group "
                f"(flatten={hypers[gi].flatten}) lays them out as {tuple(shape)}; load the "
                "checkpoint into an optimizer whose group has the same flatten"
            )
    return afresh


def detach_aliases(loaded: dict[Tensor, dict[str, Entry]], state: dict) -> None:
    """Copy loaded tensors that share memory with live state (our own ``state_dict()``
    reloaded, perhaps with entries swapped): copying one into place would change another
    before it is read."""
    live = {
        local(t).untyped_storage().data_ptr()
        for values in state.values()
        if isinstance(values, Mapping)
        for t in values.values()
        if isinstance(t, Tensor)
    }
    for entry in loaded.values():
        for key, (fmt, tensors) in entry.items():
            entry[key] = (
                fmt,
                tuple(t.clone() if t.untyped_storage().data_ptr() in live else t for t in tensors),
            )


def copy_state(states, state: dict, groups, loaded: dict[Tensor, dict[str, Entry]]) -> None:
    """Write loaded values into the live state tensors, converting between formats (through
    fp32: ``StateFormat.to_dense`` / ``from_dense``) where they differ; state not in the dict
    is zeroed (``check_live_layout``'s arguments)."""
    for gi, p in group_pairs(groups):
        algorithm = states.algorithms[groups[gi]["algorithm"]]
        fmt = states.store.formats[p]
        live = state[p]
        for key, kind, _ in algorithm.state_shapes(local(p).shape):
            targets = tuple(local(live[name]) for name in fmt.names(key))
            if p not in loaded:
                for t in targets:
                    t.zero_()
                continue
            source_fmt, source = loaded[p][key]
            if fmt.same_layout(source_fmt):  # copy (casting dense dtypes)
                for t, v in zip(targets, source, strict=True):
                    t.copy_(v)
            else:
                fmt.from_dense(source_fmt.to_dense(source, kind), kind, targets)


def loaded_matrices(algorithms: dict, hyper: Hyper, p: Tensor) -> int:
    """How many matrices ``p``'s state counts blocks over on this rank in a group read as
    ``hyper``: its algorithm's (``Algorithm.matrices``: a Muon stack's, unless it flattens)."""
    return algorithms[hyper.algorithm].matrices(local(p).shape, hyper)


def loadable_formats(states, p: Tensor) -> tuple[StateFormat, ...]:
    """The formats a loaded entry of ``p`` may hold besides dense: its own, then the policy's
    (``states``: the optimizer's ``StateBuilder``)."""
    formats = (states.format(p), *states.policy.loadable())
    return tuple(f for f in dict.fromkeys(formats) if not isinstance(f, Dense))


class Checkpoints:
    """What the optimizer's ``state_dict``, ``load_state_dict`` and ``__getstate__`` do. Each
    is handed the optimizer (``opt``: its groups, state, hooks and group reads are torch's
    and its own) and torch's method of that name, which it runs inside."""

    def __init__(self, settings, streams, states, counts, handed_scales, plans) -> None:
        self._settings, self._streams, self._states = settings, streams, states
        self._counts, self._handed_scales, self._plans = counts, handed_scales, plans

    def save(self, opt, torch_state_dict: Callable[[], dict]) -> dict:
        self._streams.synchronize()
        self._handed_scales.pull()  # scales loaded in place into the last state_dict()
        # 8-bit scales of DTensor parameters: as DTensors that distributed checkpoints shard.
        out = lay_out(opt, torch_state_dict())
        state = out["state"]
        for i, (gi, p) in enumerate(opt._params()):
            algorithm = opt.algorithms[opt.param_groups[gi]["algorithm"]]
            if algorithm.counts_steps and i in state:
                # The live count (a view the next step reads: an in-place load restores it), in
                # a new dict, so the live state holds no count of its own.
                state[i] = {**state[i], opt.step_count_key: self._counts.tensor(p)}
        return out

    def load(self, opt, state_dict: dict) -> None:
        """Load into the existing state tensors (host slabs stay where they are), converting
        dtype and device as needed. Everything is checked before anything is written."""
        state_dict = state_dict.copy()
        for hook in opt._optimizer_load_state_dict_pre_hooks.values():
            result = hook(opt, state_dict)
            if result is not None:
                state_dict = result
        saved_groups, saved_state = check_structure(state_dict)
        new_groups = check_groups(opt.param_groups, saved_groups)
        hypers = [opt._read_hyper(g, i) for i, g in enumerate(new_groups)]
        loaded = check_state(
            opt.param_groups,
            saved_groups,
            saved_state,
            hypers,
            opt.algorithms,
            partial(loadable_formats, self._states),
            lambda gi, p: loaded_matrices(self._states.algorithms, hypers[gi], p),
        )
        counted = [opt.algorithms[h.algorithm].counts_steps for h in hypers]
        counts = loaded_counts(opt.param_groups, saved_groups, saved_state, counted)
        self._streams.synchronize()
        detach_aliases(loaded, opt.state)
        # State made before the parameters moved moves first.
        self._states.follow_device(opt.state, opt.param_groups, hypers, opt._placement)
        for p in check_live_layout(self._states, opt.state, opt.param_groups, hypers):
            opt.state[p] = {}  # as made, of another layout: made afresh by the next line
        # May allocate (and fail) before anything is written.
        self._states.ensure(opt.state, opt.param_groups, hypers, opt._placement)
        for group, new in zip(opt.param_groups, new_groups, strict=True):
            group.clear()
            group.update(new)
        copy_state(self._states, opt.state, opt.param_groups, loaded)
        for key in [k for k in opt.state if not isinstance(k, Tensor)]:
            del opt.state[key]  # as torch's load: the loaded dict's own entries replace them
        opt.state.update(carried(saved_state, saved_groups))
        for p, count in counts.items():
            self._counts.set(p, count)
        self._counts.drop_retired()
        self._handed_scales.clear()
        self._states.store.pristine.clear()
        self._plans.clear()
        for hook in opt._optimizer_load_state_dict_post_hooks.values():
            hook(opt)

    def for_copy(self, opt, torch_getstate: Callable[[], dict]) -> dict:
        """For ``copy.deepcopy``, ``pickle`` and ``torch.save(opt)``: settings, groups and
        state values; the copy builds its own host slabs and streams (``restore_copy``)."""
        if any(opt._mesh_of(gi).group is not None for gi in range(len(opt.param_groups))):
            raise TypeError(
                "an optimizer with a distributed mesh cannot be copied or pickled (process "
                "groups are not picklable); save opt.state_dict() instead"
            )
        self._streams.synchronize()
        self._handed_scales.pull()
        # The counts of parameters with state (one whose state was dropped starts afresh).
        counts = {p: self._counts.get(p) for _, p in opt._params() if opt.state.get(p)}
        state = {**torch_getstate(), "_settings": self._settings.now, "_step_counts": counts}
        if "algorithms" in vars(opt):  # Muon's own (its orthogonalizer); AdamW's are its class's
            state["algorithms"] = opt.algorithms
        return state


def restore_copy(opt, state: dict, torch_setstate: Callable[[dict], None]) -> None:
    """``__setstate__``: a copy's groups and settings, its own parts, its state made as at
    construction and the copied values loaded into it."""
    state = dict(state)
    values, settings = state.pop("state"), state.pop("_settings")
    counts = state.pop("_step_counts", {})
    torch_setstate({**state, "state": {}})
    opt._setup(settings, resolve_mesh(None))
    opt._constructed = True
    for group in opt.param_groups:  # no meshes here, but DTensor parameters may be
        graphing = opt._graphing
        graphing.blocker = graphing.blocker or capture_rules.group_blocker(group, None)
    opt.state = defaultdict(dict)
    formats = partial(loadable_formats, opt._states)
    hypers = [opt._read_hyper(g, i) for i, g in enumerate(opt.param_groups)]
    algorithms = [opt.algorithms[h.algorithm] for h in hypers]
    loaded = {
        p: {
            key: _checked_entry(values[p], key, kind, p, "copy", formats(p), None, shapes)
            for key, kind, shapes in key_shapes(algorithms[gi], p)
        }
        for gi, p in opt._params()
        if values.get(p)
    }
    # Every parameter's, as at construction.
    opt._states.ensure(opt.state, opt.param_groups, hypers, opt._placement)
    if loaded:
        copy_state(opt._states, opt.state, opt.param_groups, loaded)
        opt._store.pristine.clear()
    opt.state.update({k: v for k, v in values.items() if not isinstance(k, Tensor)})
    for p, count in counts.items():
        opt._counts.set(p, count)
