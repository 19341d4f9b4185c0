"""A plan's new kernels compiled in parallel before its step runs them.

On a fresh machine a first step is bound by Triton compiling its kernel variants one after
another, inside the step (0.5 to 3.4 s each, twenty for a mixture-of-experts model). Before a
step whose plan holds units of a kind this process has not run, ``before`` runs
one unit of each new kind inside ``kernels.precompile.compile_then_tune``: there the launches
only compile, each on a pool of worker processes at once (started at the optimizer's
construction: ``prestart``), keys new to the tuner are timed after its first block, while a
unit whose keys are timed compiles its winners in the second (one callable a unit), and the
step that follows finds every variant compiled, its launcher made, and every key decided.

A unit's kind is what its variants are read off: the algorithm and the settings its launches
bake (``Algorithm.baked``), the state format, and each tensor's shape, strides, dtype and
16-byte alignment, so the batch's count too (some tuning keys bucket it). The unit run ahead
is a scratch twin: for each of its lists (parameters, gradients, each state tensor) one zeroed
buffer a dtype on the device, which every item of that list views at its shape, strides and
alignment residue (nothing runs inside the block, so items may share bytes: one item's memory
a list, not the unit's); its scalars are a zeroed row of the same length, its gradients' table
its own. The user's tensors, gradients and state are only read for their metadata.

Not run ahead: a matrix unit of a mesh or of DTensor parameters (its update calls collectives;
its kernels compile in the step as before), and one whose orthogonalizer is the user's function
(called only on the user's tensors: it may keep state). The random state is restored after the
pass (a tuner's scratch draws from it). Off the Triton path, off CUDA, with
``MUON_OFFLOAD_PARALLEL_COMPILE=0`` and under a capture nothing happens; a step with new kinds
is never captured (a graph is captured on a step whose key the last one had). Whatever fails
in the pass is a warning, once a process, and the step runs as it would without it.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from ..kernels import precompile
from ..kernels._launch import ALIGN_BYTES, capturing
from .algorithm import UnitJob, runs_triton
from .chunks import ChunkLayout, StepContext, UnitLayout, _job, chunk_state

log = logging.getLogger(__name__)

_SEEN: set[tuple] = set()  # the kinds this process ran (or tried) ahead: compiled for good
_LOCK = threading.Lock()
_WARNED = [False]  # a failed pass is said once a process


# optimizer -> the layouts of the last plan looked at: a step of the same plan costs a lookup
_LOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def before(
    opt,
    ctx: StepContext,
    layouts: Sequence[ChunkLayout],
    rows: Sequence[Sequence[Tensor]] | None,
    device: torch.device | None,
) -> None:
    """Before ``opt``'s step: compile ahead the kernels of the units of ``layouts`` of kinds
    not yet run (``rows``: the step's scalar rows, None off the Triton path). Never raises an
    ``Exception``."""
    if _LOOKED.get(opt) is layouts:
        return
    if device is None or not runs_triton(ctx.backend, device) or rows is None:
        _LOOKED[opt] = layouts
        return
    if not precompile.enabled(device) or capturing(device):
        return  # looked at again next step: the switch is read per step
    _LOOKED[opt] = layouts
    try:
        compile_ahead(ctx, layouts, rows, device)
    except Exception as err:  # noqa: BLE001 (the step runs as without the pass)
        if not _WARNED[0]:
            _WARNED[0] = True
            log.warning(
                "muon-offload: compiling the step's new kernels ahead failed (%s: %s); they "
                "compile in the step, one after another",
                *(type(err).__name__, err),
            )


def compile_ahead(ctx: StepContext, layouts, rows, device: torch.device) -> int:
    """Run one scratch unit of each new kind inside ``compiling_ahead``; the number run."""
    todo, skipped = _new_kinds(ctx, layouts, rows, device)
    if not todo:
        return 0
    with _LOCK:  # tried once, whatever happens below: a failure is not retried each step
        _SEEN.update(kind for kind, _ in todo)
    what = f"kernels of {len(todo)} new kinds of units"
    if skipped:
        what += f" ({skipped} distributed units left to the step)"
    # The random state as it was: a tuner's scratch (``scratch_like``) draws from it.
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(cuda):
        # One callable a unit: its tuned winners compile as soon as its own keys are timed.
        runs = [functools.partial(_run, unit, _scratch_job(job, device)) for _, (unit, job) in todo]
        precompile.compile_then_tune(device, runs, what)
    return len(todo)


def prestart(opt) -> None:
    """At ``opt``'s construction: where its first step will compile ahead (the Triton path on
    CUDA), start the compile workers now, in the background (``precompile.prestart``): their
    interpreters and imports are done by the time the first step's pass needs them. Never
    raises an ``Exception``."""
    try:
        device = next((p.device for g in opt.param_groups for p in g["params"]), None)
        if device is not None and runs_triton(opt.backend, device):
            precompile.prestart(device)
    except Exception:  # noqa: BLE001, S110 (the pass starts its own)
        pass


def _new_kinds(ctx: StepContext, layouts, rows, device) -> tuple[list, int]:
    """[(kind, (unit layout, its job on the real tensors))] of one unit of each kind not yet
    seen, and how many units of new kinds cannot run ahead."""
    todo: dict[tuple, tuple[UnitLayout, UnitJob]] = {}
    skipped = 0
    with _LOCK:
        seen = set(_SEEN)
    for i, layout in enumerate(layouts):
        # A streamed chunk's jobs take its host state: the staging views have its shapes and
        # alignment residues (``scheduler.plan_transfer``).
        host = (
            None
            if layout.chunk.resident
            else chunk_state(ctx.state, ctx.formats, layout.chunk, ctx.work)
        )
        for k, unit in enumerate(layout.units):
            job = _job(ctx, unit, host, rows[i][k], None)
            kind = _kind(unit, job, device)
            if kind in seen or kind in todo:
                continue
            if not unit.algorithm.elementwise and (not unit.plain or unit.mesh.group is not None):
                skipped += 1
                continue
            if callable(getattr(unit.algorithm, "orthogonalizer", None)):
                continue  # the user's function: not called on scratch (it may keep state)
            todo[kind] = (unit, job)
    return list(todo.items()), skipped


def _lists(job: UnitJob) -> list[Sequence[Tensor]]:
    return [job.params, job.grads, *job.state]


def _spec(t: Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % ALIGN_BYTES


def _kind(unit: UnitLayout, job: UnitJob, device: torch.device) -> tuple:
    algorithm = unit.algorithm
    lists = tuple(tuple(map(_spec, tensors)) for tensors in _lists(job))
    baked = algorithm.baked(job.hyper)
    return (device, type(algorithm), algorithm.name, baked, job.backend, job.fmt, lists)


def _scratch_list(tensors: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """Views of one zeroed buffer a dtype, each at its tensor's shape, strides and alignment
    residue (an element count: ``data_ptr`` is a multiple of the element size)."""
    placed, sizes = [], {}
    for t in tensors:
        offset = (t.data_ptr() % ALIGN_BYTES) // t.element_size()
        steps = zip(t.shape, t.stride(), strict=True)
        extent = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in steps)
        placed.append((t, offset))
        sizes[t.dtype] = max(sizes.get(t.dtype, 0), offset + extent)
    # The caching allocator hands out blocks on 512-byte boundaries: offset 0 is aligned.
    buffers = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
    return [buffers[t.dtype].as_strided(t.shape, t.stride(), offset) for t, offset in placed]


def _scratch_job(job: UnitJob, device: torch.device) -> UnitJob:
    params, grads, *state = (_scratch_list(tensors, device) for tensors in _lists(job))
    scalars = None if job.scalars is None else torch.zeros_like(job.scalars, device=device)
    return UnitJob(
        group=job.group,
        hyper=job.hyper,
        step=job.step,
        backend=job.backend,
        mesh=job.mesh,
        params=params,
        grads=grads,
        state=state,
        fmt=job.fmt,
        scalars=scalars,
        plain=True,
        grad_index=None,  # a table of the scratch gradients' own addresses
    )


def _run(unit: UnitLayout, job: UnitJob) -> None:
    running = unit.algorithm.run(job)
    if running is not None:  # a local unit's generator yields for no collective
        for _ in running:
            pass
