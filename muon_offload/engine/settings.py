"""The engine's constructor arguments, checked once, before anything is built: the one place
their defaults are derived. ``reconfigure`` and an assigned attribute (``opt.chunk_bytes``)
make new ``Settings`` through the same checks (``Settings.replace``), so what the planner and
the state store read is always a checked whole."""

from __future__ import annotations

import inspect
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch

from .algorithm import BACKENDS

# The fastest offloaded step for fp32 state in the chunk-size sweep on the H200, within 1% of
# the best for bf16 (docs/benchmarks.md, "Choosing chunk_bytes").
DEFAULT_CHUNK_BYTES = 128 << 20
# Steps never captured (cuda_graph=False) of an algorithm that updates batches of whole
# matrices (Muon): each step is as long as its host takes to issue it, 17 launches a Muon
# batch, so fewer, larger batches win there; a graph replays launches at no host cost and
# overlaps more with smaller chunks. Eager steps take this budget for their resident chunks
# and, with 8-bit state, for their streamed ones (at the fp32 width Muon budgets 8-bit state
# at: 256 MiB of codes); fp32 and bf16 state keep DEFAULT_CHUNK_BYTES, their steps bound by
# the link. In the Qwen3-MoE training loop on the H200 (docs/benchmarks.md, "Eager steps"),
# 512 MiB cut the eager 8-bit step from 126 to 58 ms and its iteration from 0.429 to 0.355 s
# (the graphed step was 1.7% slower at that size); 1 GiB cut its launches from 258 to 139
# and its host time further, for 0.4 GiB more peak memory.
DEFAULT_EAGER_CHUNK_BYTES = 1 << 30
# Muon with 8-bit state, its steps replayed as graphs: 512 MiB at the fp32 width Muon budgets
# 8-bit state at (128 MiB of codes a chunk, batches as large as the resident step's), the
# ends tapered (taper.py). On the H200 (docs/benchmarks.md, "The ends of a streamed step")
# against 128 MiB: the Qwen3-MoE training loop's step 50.9 ms after the clip against 52.3
# (0.496 and 0.510 of dion's Muon), the qwen3-30b-a3b-ep8-rank step 1.06 x the resident one
# against 1.12 x, for 0.2 GiB more staging.
DEFAULT_INT8_CHUNK_BYTES = 512 << 20
# Resident state crosses no bus: its chunks only set how many matrices share a batch and a
# launch. At 512 MiB the resident step is no longer host-bound (docs/benchmarks.md); the cost
# is the orthogonalizer's workspace, which scales with the batch.
DEFAULT_RESIDENT_CHUNK_BYTES = 512 << 20
# Muon loads ahead by default (prefetch_bytes) three fifths of the bytes a step streams in fp32
# or bf16, a third in 8-bit, at most 3 GiB: the staging arena holds that much (or its ring of
# three of the step's largest chunks, if more). Its first bytes load under backward
# (prefetch.py), its last ones store under the next backward (graph_ends.py, tail_pacer.py),
# and in a step nothing prefetched (one graph) loads run that far ahead of updates, which
# evens out chunks of more compute with chunks of more bytes. A step bound by the link moves
# the rest both ways at once (on the H200, 48.8 GB/s each way: the Qwen3-MoE loop's fp32
# step is 6.5 ms + its bytes not ahead / 48.8 GB/s within 2 ms), so only bytes ahead shorten
# it. On the H200 (docs/benchmarks.md, "A thread for the tail"), that loop's fp32 iteration
# (5.53 GB streamed) against the resident one: 1.03 to 1.06 x with 3 GiB ahead (the default's
# bytes there), 1.05 to 1.10 x with a half (0.42 GiB less), 1.09 to 1.16 x with a third (0.86
# GiB less still); its 8-bit iteration 0.98 to 1.00 x with a third, and the
# qwen3-30b-a3b-ep8-rank 8-bit step 1.03 to 1.04 x the resident one (1.06 to 1.08 x with the
# ring) for +0.84 GiB. AdamW alone keeps the ring.
DEFAULT_PREFETCH_SHARE = (3, 5)
DEFAULT_INT8_PREFETCH_SHARE = (1, 3)
DEFAULT_PREFETCH_CAP = 3 << 30
STATE_DTYPES = (None, torch.float32, torch.bfloat16, torch.int8)

# What each setting does, once: the docstrings of the classes that take them end with it
# (``takes_settings``).
SETTINGS_DOC = f"""
    The engine's settings (keyword arguments):
        offload: keep optimizer state in pinned host memory and stream it through the GPU in
            chunks during ``step()``.
        chunk_bytes: state bytes per chunk (default {DEFAULT_CHUNK_BYTES >> 20} MiB; with 8-bit
            state and Muon, {DEFAULT_INT8_CHUNK_BYTES >> 20} MiB, counted at fp32 width, and
            {DEFAULT_EAGER_CHUNK_BYTES >> 20} MiB with ``cuda_graph=False``: steps issued
            eagerly are bound by their launches, and larger chunks need fewer).
        resident_bytes: with offload, this much state stays on the GPU (default 0).
        resident_chunk_bytes: state bytes updated together where none is streamed (resident
            state: all of it without offload): default {DEFAULT_RESIDENT_CHUNK_BYTES >> 20} MiB
            ({DEFAULT_EAGER_CHUNK_BYTES >> 20} MiB for Muon with ``cuda_graph=False``), or
            ``chunk_bytes`` if larger. It sets how many same-shape matrices are orthogonalized
            in one batch.
        state_dtype: dtype of the state; None (default) keeps the parameter's dtype, as dion.
        backend: ``"auto"`` (Triton kernels on CUDA, torch elsewhere), ``"triton"``, ``"torch"``.
        cuda_graph: ``"auto"`` (default): capture the step as a CUDA graph once it is stable
            and replay it while the gradients, parameters and state stay where they are
            (hyper-parameter changes reach the replay), wherever a graph can run (parameters
            on CUDA, the Triton kernels, no ``closure``, and the collectives of a
            ``distributed_mesh`` or of DTensor parameters, if any, through NCCL in one
            process); other steps run eagerly. ``True``: the same, NCCL collectives across
            processes included, but refuses what it cannot capture; ``False``: never. The
            graph's memory pool (about one step's temporaries) is kept from the caching
            allocator; see docs/usage.md ("CUDA graphs").
        prefetch: with offload, the first gradient accumulated in backward starts loading the
            next step's first chunks of state (``prefetch()``; default True). ``False``: no
            hooks.
        prefetch_bytes: with offload, how much of the next step's state loads ahead of it
            (under backward, with ``prefetch``), and as much of a step's last stores is left
            to finish under what follows it: the device bytes that stage streamed state (or
            the step's ring of three of its largest chunks, if more). None (default): for
            ``Muon`` three fifths of the state a step streams (a third with 8-bit state), at most
            {DEFAULT_PREFETCH_CAP >> 30} GiB; for ``AdamW`` 0, the ring alone.
"""


def eager_batches(cuda_graph: bool | str, batches_matrices: bool) -> bool:
    """Steps never captured that update batches of whole matrices: bound by their launches,
    so they take DEFAULT_EAGER_CHUNK_BYTES (the constant's comment says why)."""
    return cuda_graph is False and batches_matrices


def default_chunk_bytes(
    state_dtype: torch.dtype | None, cuda_graph: bool | str, batches_matrices: bool
) -> int:
    """``chunk_bytes`` when none is given (the constants' comments say why). Larger eager
    chunks pay where units are many launches each (batches of matrices); an element-wise
    chunk is one launch, and larger ones would only take more staging memory."""
    if state_dtype == torch.int8 and batches_matrices:
        return DEFAULT_EAGER_CHUNK_BYTES if cuda_graph is False else DEFAULT_INT8_CHUNK_BYTES
    return DEFAULT_CHUNK_BYTES


def default_resident_chunk_bytes(cuda_graph: bool | str, batches_matrices: bool) -> int:
    """``resident_chunk_bytes`` when none is given, before ``chunk_bytes`` raises it: eager
    steps of batched matrices take the larger budget (fewer launches), as their chunks do."""
    if eager_batches(cuda_graph, batches_matrices):
        return DEFAULT_EAGER_CHUNK_BYTES
    return DEFAULT_RESIDENT_CHUNK_BYTES


def as_int(name: str, value, minimum: int, what: str) -> int:
    """An integral number (int, numpy integer, ...; never bool or float) >= minimum."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return number


def check_positive_int(name: str, value) -> int:
    return as_int(name, value, 1, "a positive int")


class SettingsArgs(TypedDict, total=False):
    """``Settings.check``'s keyword arguments, for type checkers: the public constructors take
    them as ``**settings: Unpack[SettingsArgs]`` (a test keeps the two lists equal)."""

    offload: bool
    chunk_bytes: int | None
    resident_bytes: int | None
    resident_chunk_bytes: int | None
    state_dtype: torch.dtype | None
    backend: str
    cuda_graph: bool | str
    prefetch: bool
    prefetch_bytes: int | None


@dataclass(frozen=True)
class Settings:
    offload: bool
    chunk_bytes: int
    resident_chunk_bytes: int
    resident_bytes: int | None  # None: everything resident (offload off)
    state_dtype: torch.dtype | None
    backend: str
    cuda_graph: bool | str = "auto"
    prefetch: bool = True  # backward starts the next step's first loads (prefetch.py)
    prefetch_bytes: int | None = None  # None: the default (``staging_for``)
    # Some algorithm updates batches of whole matrices (Muon): from the engine, not the user.
    batches_matrices: bool = False

    @property
    def tapers(self) -> bool:
        """Whether a step's plan has its streamed ends halved (taper.py): not for steps never
        captured that update batches of matrices, whose time is their host's launches (the
        eager 8-bit default's 1 GiB chunks would take six more batches, about a hundred
        launches, for ends that its host-bound pace hides anyway)."""
        return not eager_batches(self.cuda_graph, self.batches_matrices)

    def staging_for(self, streamed_bytes: int) -> int:
        """Device bytes to stage a step streaming ``streamed_bytes`` in, at least (the arena
        holds the step's ring of chunks if that is more): ``prefetch_bytes``, or its default
        (``DEFAULT_PREFETCH_SHARE``'s comment), never more than the step streams."""
        if self.prefetch_bytes is None:
            if not self.batches_matrices:
                return 0
            int8 = self.state_dtype == torch.int8
            share = DEFAULT_INT8_PREFETCH_SHARE if int8 else DEFAULT_PREFETCH_SHARE
            return min(streamed_bytes * share[0] // share[1], DEFAULT_PREFETCH_CAP)
        return min(self.prefetch_bytes, streamed_bytes)

    @property
    def elementwise_chunk_bytes(self) -> int:
        """Element-wise state a streamed chunk holds at most. Where Muon budgets 8-bit state
        at fp32 width (the 8-bit defaults' large chunks), a matrix chunk stages a quarter of
        ``chunk_bytes`` in codes; element-wise state, budgeted at its own width, is held to
        that quarter (at least DEFAULT_CHUNK_BYTES), so that large AdamW groups do not size the
        staging arena (three of the largest chunk) at 3 x ``chunk_bytes``. An element-wise
        unit is one launch whatever its size, so the cap costs a launch per extra chunk at
        most. Elsewhere: ``chunk_bytes``."""
        if self.state_dtype == torch.int8 and self.batches_matrices:
            return min(self.chunk_bytes, max(self.chunk_bytes // 4, DEFAULT_CHUNK_BYTES))
        return self.chunk_bytes

    @classmethod
    def check(
        cls,
        *,
        offload: bool = False,
        chunk_bytes: int | None = None,
        resident_bytes: int | None = 0,
        resident_chunk_bytes: int | None = None,
        state_dtype: torch.dtype | None = None,
        backend: str = "auto",
        cuda_graph: bool | str = "auto",
        prefetch: bool = True,
        prefetch_bytes: int | None = None,
        backends: Sequence[str] = BACKENDS,
        batches_matrices: bool = False,
    ) -> Settings:
        """The constructors' settings (``SETTINGS_DOC``), their defaults here alone.
        ``backends``: the ``backend`` settings every algorithm's launchers take
        (``algorithm.common_backends``); ``batches_matrices``: some algorithm updates batches
        of whole matrices (Muon), whose eager steps want larger chunks."""
        # "no" or 0.0 would read as a truth value; say what is wanted instead.
        if not isinstance(offload, bool):
            raise ValueError(f"offload must be True or False, got {offload!r}")
        if cuda_graph not in (True, False, "auto") or not isinstance(cuda_graph, (bool, str)):
            raise ValueError(f"cuda_graph must be True, False or 'auto', got {cuda_graph!r}")
        if not isinstance(prefetch, bool):
            raise ValueError(f"prefetch must be True or False, got {prefetch!r}")
        if chunk_bytes is None:
            chunk_bytes = default_chunk_bytes(state_dtype, cuda_graph, batches_matrices)
        chunk_bytes = check_positive_int("chunk_bytes", chunk_bytes)
        if resident_chunk_bytes is None:
            resident_chunk_bytes = max(
                chunk_bytes, default_resident_chunk_bytes(cuda_graph, batches_matrices)
            )
        resident_chunk_bytes = check_positive_int("resident_chunk_bytes", resident_chunk_bytes)
        if resident_bytes is not None:
            resident_bytes = as_int("resident_bytes", resident_bytes, 0, "an int >= 0 or None")
        if prefetch_bytes is not None:
            prefetch_bytes = as_int("prefetch_bytes", prefetch_bytes, 0, "an int >= 0 or None")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(
                "state_dtype must be None, torch.float32, torch.bfloat16 or torch.int8, got "
                f"{state_dtype!r}"
            )
        if backend not in backends:
            raise ValueError(f"backend must be one of {tuple(backends)}, got {backend!r}")
        return cls(
            offload=offload,
            chunk_bytes=chunk_bytes,
            resident_chunk_bytes=resident_chunk_bytes,
            # Without offload everything is resident; with it, resident_bytes of state stay.
            resident_bytes=resident_bytes if offload else None,
            state_dtype=state_dtype,
            backend=backend,
            cuda_graph=cuda_graph,
            prefetch=prefetch,
            prefetch_bytes=prefetch_bytes,
            batches_matrices=batches_matrices,
        )

    def replace(self, backends: Sequence[str], **changes) -> Settings:
        """These settings with ``changes``, through ``check`` again: the same errors, raised
        before anything is kept. A budget not named keeps its value (not derived afresh)."""
        return Settings.check(**{**vars(self), **changes}, backends=backends)


class LiveSettings:
    """The optimizer's settings as they are now, one object that the optimizer and the
    collaborators reading them each step share: the constructor's, replaced only by what
    ``changed`` returns (``reconfigure``, an assigned ``opt.chunk_bytes``)."""

    def __init__(self, settings: Settings, backends: Sequence[str]) -> None:
        self.now = settings
        self.backends = tuple(backends)  # the ``backend`` settings every algorithm takes

    def changed(self, **changes) -> Settings:
        """The settings with ``changes``, checked as the constructor's were; not kept."""
        return self.now.replace(self.backends, **changes)


class Setting:
    """An optimizer attribute (``opt.chunk_bytes``) that is its settings' field: read from
    ``opt._settings.now`` (``LiveSettings``); assigned, it replaces them through the checks
    (``Settings.replace``). ``prefetch`` is a method; its setting is ``Settings.prefetch``.
    ``fixed``: a setting the state is made by (where it lives, its format), made with the
    optimizer: assigning it raises, since the state would stay as it is."""

    def __init__(self, fixed: bool = False) -> None:
        self.fixed = fixed

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, opt, owner=None):
        return self if opt is None else getattr(opt._settings.now, self.name)

    def __set__(self, opt, value) -> None:
        if self.fixed:
            raise AttributeError(
                f"{self.name} is fixed when the optimizer is made (its state is made with it "
                f"and stays as it is): make a new optimizer with {self.name}={value!r} and load "
                "this one's state_dict() into it (8-bit and dense state convert as they load)"
            )
        opt._settings.now = opt._settings.changed(**{self.name: value})


# ``Settings.check``'s arguments that the engine passes (its algorithms'), not the user.
ENGINE_ONLY = ("backends", "batches_matrices")


def takes_settings(cls):
    """For a class whose ``__init__`` ends with ``**settings`` (passed on to ``Settings.check``):
    its signature (``inspect.signature``, ``help``) shows each setting as a keyword argument
    with its default, and its docstring ends with what they do (``SETTINGS_DOC``)."""
    own = inspect.signature(cls.__init__).parameters.values()
    settings = inspect.signature(Settings.check).parameters.values()
    cls.__init__.__signature__ = inspect.Signature(
        [p for p in own if p.kind is not p.VAR_KEYWORD]
        + [p for p in settings if p.name not in ENGINE_ONLY]
    )
    cls.__doc__ = (cls.__doc__ or "") + SETTINGS_DOC
    return cls
