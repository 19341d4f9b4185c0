"""``Muon``: dion's Muon (microsoft/dion at 0a059a4) on the chunked, optionally offloaded,
engine. Same constructor, param-group keys, update rules and state keys (``momentum``, and
``variance`` for adamw groups), so a dion user swaps the class and keeps the rest."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..distributed import local, orthogonalize_replicated, orthogonalize_sharded, placement_of
from ..engine import ChunkedOptimizer
from ..engine.algorithm import Algorithm, Hyper, UnitJob
from ..engine.settings import takes_settings
from ..kernels._grad_index import TabledGrads
from ..kernels._tables import ALIGN_BYTES, aligned_addresses
from ..kernels.muon import apply_scalars
from ..kernels.orthogonalize import ORTHOGONALIZERS
from . import muon_launch as launch
from .elementwise import AdamWUpdate, LionUpdate
from .hyper import ADJUST_LR_MODES, check_beta, read_hyper
from .muon_shapes import (
    adjusted_lr,
    heads_view,
    matrix_count,
    matrix_view_shape,
    split_lr_scales,
)

if TYPE_CHECKING:  # typing_extensions (a torch dependency): Unpack on Python 3.10
    from typing_extensions import Unpack

    from ..engine.settings import SettingsArgs


class MuonUpdate(Algorithm):
    """One Muon unit (a batch of same-shape matrices): prep, orthogonalize (with dion's
    collectives when the mesh needs them), apply."""

    name = "muon"
    elementwise = False
    state_kinds = ("momentum",)
    kernels = ("dense", "int8")  # the prep kernels of fp32 / bf16 and of 8-bit momentum

    def __init__(self, state_keys: tuple[str, ...], orthogonalizer):
        super().__init__(state_keys)
        self.orthogonalizer = orthogonalizer

    def scalars(self, hyper: Hyper, step: int, shape) -> tuple[float, ...]:
        """[mu, -, -, -, eps, -, -, -, 1 - lr wd, adjusted_lr]: each launch's part starts 16
        bytes in (prep reads [0], the normalization [4], apply [8:10])."""
        h = hyper
        shape = heads_view(shape, h.num_heads)
        apply = apply_scalars(
            h.lr, h.weight_decay, adjusted_lr(h.lr, shape, h.adjust_lr, h.flatten)
        )
        return (h.mu, 0.0, 0.0, 0.0, h.eps, 0.0, 0.0, 0.0, *apply)

    def grad_pieces(self, hyper: Hyper, shape: tuple) -> tuple[int, ...]:
        """One piece a matrix, as ``update`` cuts a parameter (``_matrices``)."""
        shape = heads_view(shape, hyper.num_heads)
        if hyper.flatten or len(shape) == 2:
            return (0,)
        rows, cols = matrix_view_shape(shape, False)
        return tuple(k * rows * cols for k in range(matrix_count(shape, False)))

    def matrices(self, shape: torch.Size, hyper: Hyper) -> int:
        """A stack's matrices (each orthogonalized on its own, so the planner may cut between
        them); one for a 2-D weight (``num_heads`` ones too: the update cuts their heads from
        the whole) and for a ``flatten`` group's."""
        return matrix_count(shape, hyper.flatten)

    def placement(self, param, mesh, hyper: Hyper, where: str):
        """Local, replicated (spread over the mesh's ranks) or sharded (all-to-all):
        ``distributed.placement_of``, which refuses what the collectives cannot serve."""
        return placement_of(param, mesh, hyper.flatten, where, hyper.num_heads)

    def budget_bytes(self, state_bytes: int, numel: int, mesh_size: int) -> int:
        """State narrower than fp32 counts as fp32: a Muon chunk's work on the GPU (the bf16
        update, the Gram products) grows with its matrices, not with the state's width. Counted
        in 8-bit bytes, a chunk held 4 x the matrices of an fp32 one and the step added 1.55
        instead of 0.67 GiB (H200, 8 qwen3 layers, 2026-12-01)."""
        return max(state_bytes, -(-(len(self.state_keys) * numel * 4) // mesh_size))

    def baked(self, hyper: Hyper) -> tuple:
        h = hyper
        # A callable orthogonalizer takes eps as a Python number (dion's signature).
        eps = h.eps if callable(self.orthogonalizer) else None
        orthogonalizer = id(self.orthogonalizer)
        key = (h.nesterov, h.adjust_lr, h.flatten, h.split_sizes, h.num_heads, orthogonalizer, eps)
        return (*key, h.cautious_wd)

    def update(self, job: UnitJob) -> Iterator[None]:
        h, params, row = job.hyper, job.params, job.scalars
        # Per head: the global shape's head rows, so a shard of whole heads (dim 0 sharded)
        # is cut into its own heads.
        rows = h.num_heads and params[0].shape[0] // h.num_heads
        int8 = job.fmt.kernels == "int8"  # 8-bit momentum: codes, then one row of scales a matrix
        if params[0].ndim == 2 and not h.flatten and not int8 and not rows:
            # Each tensor is its one matrix (what ``_matrices`` gives, without a list a tensor).
            xs = params if job.plain else [local(p) for p in params]
            gs, ms, scales = job.grads, job.state[0], []
        else:
            xs, ms, scales = _unit_matrices(job, h.flatten, rows, int8)
            gs = _grad_matrices(job, h.flatten, rows, ms)
        if not ms:  # a stack sharded along its batch dim, with no matrices on this rank
            return
        mu = h.mu if row is None else row[0:1]
        if ms[0].numel() and int8:
            update, sumsq = launch.muon_prep8(
                job.backend, ms, scales, gs, mu=mu, nesterov=h.nesterov, grad_index=job.grad_index
            )
        elif ms[0].numel():
            update, sumsq = launch.muon_prep(
                job.backend, ms, gs, mu=mu, nesterov=h.nesterov, grad_index=job.grad_index
            )
        else:  # an empty shard still takes part in every collective
            update = torch.empty((len(ms), *ms[0].shape), dtype=torch.bfloat16, device=ms[0].device)
            sumsq = torch.zeros(len(ms), dtype=torch.float32, device=ms[0].device)
        # The global shape (per head): the lr adjustment is the whole matrix's.
        shape = heads_view(params[0].shape, h.num_heads)
        scales = h.split_sizes and split_lr_scales(h.split_sizes, shape, h.adjust_lr)
        eps = h.eps if row is None or callable(self.orthogonalizer) else row[4:5]

        def orthogonalize(u: Tensor, s: Tensor | None) -> Tensor:
            return launch.orthogonalize_batch(
                u,
                s,
                method=self.orthogonalizer,
                eps=eps,
                split_sizes=h.split_sizes,
                split_scales=scales,
            )

        where = f"param group {job.group} (parameter of shape {tuple(shape)})"
        placement = placement_of(params[0], job.mesh, h.flatten, where, h.num_heads)
        apply = dict(
            lr=h.lr,
            weight_decay=h.weight_decay,
            adjusted_lr=adjusted_lr(h.lr, shape, h.adjust_lr, h.flatten),
            cautious_wd=h.cautious_wd,
            scalars=None if row is None else row[8:10],
        )
        if placement.kind == "local" and not h.split_sizes and xs[0].numel():
            # Whole on this rank: the apply joins the last product where that is Triton's.
            launch.orthogonalize_apply_(
                job.backend, xs, update, sumsq, method=self.orthogonalizer, eps=eps, **apply
            )
            return
        if placement.kind == "sharded":
            ortho = yield from orthogonalize_sharded(update, placement, job.mesh, orthogonalize)
        elif placement.kind == "replicated":
            ortho = yield from orthogonalize_replicated(update, sumsq, job.mesh, orthogonalize)
        else:
            ortho = orthogonalize(update, sumsq)
        if xs[0].numel():
            launch.muon_apply_(job.backend, xs, ortho, **apply)


def _unit_matrices(job: UnitJob, flatten: bool, rows, int8: bool) -> tuple[list, list, list]:
    """The matrices of the unit's parameters and momentum, and with 8-bit state each matrix's
    row of scales (``_matrices``' views, one a matrix), kept in ``job.memo`` for the next
    steps: a stack is not cut into its matrices again while its tensors come back at the same
    addresses, shapes and strides (the kept views hold the memory they view, so no other
    tensor can be found there; a parameter's storage replaced under the plan misses)."""
    xs_of = job.params if job.plain else [local(p) for p in job.params]
    sources = (*xs_of, *(t for key in job.state for t in key))
    key = (flatten, rows, int8, *((t.data_ptr(), t.dtype, t.shape, t.stride()) for t in sources))
    kept = None if job.memo is None else job.memo.get("matrices")
    if kept is not None and kept[0] == key:
        return kept[1]
    xs, ms, scales = [], [], []
    for i, (x, m) in enumerate(zip(xs_of, job.state[0], strict=True)):
        xs.extend(_matrices(x, flatten, rows))
        ms.extend(_matrices(m, flatten, rows))
        if int8:  # one row of block scales a matrix
            s = job.state[1][i]
            scales.extend(s.unbind(0) if s.ndim == 2 else [s])
    # Views only: a reshape of a tensor that is not contiguous would be a copy, stale later.
    if job.memo is not None and all(t.is_contiguous() for t in sources):
        job.memo["matrices"] = (key, (xs, ms, scales))
    return xs, ms, scales


def _grad_matrices(job: UnitJob, flatten: bool, rows, ms: list) -> list | TabledGrads:
    """The unit's gradient matrices as the prep launchers take them: where the kernels read
    their addresses from the step's gradient table (``job.grad_index``), their description
    (``TabledGrads``), which costs no view a matrix (a stack's gradient is a new tensor every
    step, so its views cannot be kept as ``_unit_matrices`` keeps the state's); else the
    views. Each gradient item is contiguous there (``GradTable.write``), its matrices in a
    row, so every matrix's address is aligned when each item's is and a matrix is a multiple
    of ``ALIGN_BYTES`` long (or each item is one matrix)."""
    if job.grad_index is None or not ms:
        return [g for grad in job.grads for g in _matrices(grad, flatten, rows)]
    first = job.grads[0]
    matrix_bytes = ms[0].numel() * first.element_size()
    aligned = aligned_addresses(map(Tensor.data_ptr, job.grads)) and (
        matrix_bytes % ALIGN_BYTES == 0 or len(ms) == len(job.grads)
    )
    return TabledGrads(len(ms), ms[0].shape, first.dtype, first.device, aligned)


def _matrices(t: Tensor, flatten: bool, head_rows: int | None = None) -> list[Tensor]:
    """The matrices a muon tensor is orthogonalized as (views, no copies for contiguous t;
    explicit sizes, so an empty shard still gives its count of empty matrices). ``head_rows``:
    a 2-D tensor cut into heads of that many rows (dion's ``num_heads``)."""
    if head_rows:
        return list(t.view(t.shape[0] // head_rows, head_rows, t.shape[1]).unbind(0))
    if flatten:
        return [t.reshape(t.shape[0], math.prod(t.shape[1:]))]
    if t.ndim == 2:
        return [t]
    return list(t.reshape(math.prod(t.shape[:-2]), t.shape[-2], t.shape[-1]).unbind(0))


@takes_settings
class Muon(ChunkedOptimizer):
    """Muon for matrices, with AdamW or Lion groups for everything else.

    Each param group carries ``algorithm`` = ``"muon"`` (default), ``"adamw"`` or ``"lion"``.
    Muon groups: ``M = mu M + G``; ``U = mu M + G`` with nesterov, else ``M``; U in bf16,
    orthogonalized (Polar Express by default), then ``X *= 1 - lr wd`` and
    ``X -= adjusted_lr U``, with ``adjusted_lr`` from ``adjust_lr`` and the matrix shape.
    3-D parameters are batches of matrices unless ``flatten``; ``split_sizes`` in a group
    orthogonalizes row blocks of a packed 2-D weight separately, as dion does, and
    ``num_heads`` (dion's) equal consecutive row blocks (an attention projection's heads),
    each with the lr adjustment of its own shape. AdamW groups'
    bias correction reads each parameter's own count of the steps that updated it, as dion's
    per-parameter ``step_dev`` (the key checkpoints keep it under); group ``step`` counts
    ``step()`` calls.

    ``distributed_mesh`` is dion's: a 1-D DeviceMesh (FSDP2 DTensor parameters), a ProcessGroup
    (DDP, replicated parameters) or None; a param group may carry its own
    ``distributed_mesh`` (e.g. experts sharded over an expert-parallel mesh).

    Beyond dion's arguments:
        orthogonalizer: ``"polar_express"``, ``"newton_schulz5"`` or a callable
            ``f(U, epsilon=eps) -> Tensor`` on a bf16 batch [B, m, n]. Overrides
            ``use_polar_express`` and ``newton_schulz_func``.
    """

    # dion's key for a parameter's step count (its adamw groups' ``state[p]["step_dev"]``).
    step_count_key = "step_dev"

    def __init__(
        self,
        params,
        distributed_mesh=None,
        lr: float = 0.01,
        mu: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        cautious_wd: bool = False,
        epsilon: float = 1e-8,
        nesterov: bool = False,
        adjust_lr: str | None = "spectral_norm",
        flatten: bool = False,
        use_gram_newton_schulz: bool = False,
        use_triton: bool = False,  # accepted for dion compatibility; kernels are always fused
        use_polar_express: bool = True,
        newton_schulz_func: Callable | None = None,
        *,
        orthogonalizer: str | Callable | None = None,
        **settings: Unpack[SettingsArgs],  # the engine's (SETTINGS_DOC, Settings.check)
    ):
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair, got {betas!r}")
        # Checked here too: groups read them only when an adamw or lion group exists.
        for i, beta in enumerate(betas):
            check_beta(beta, f"betas[{i}]")
        if adjust_lr not in ADJUST_LR_MODES:
            raise ValueError(f"unknown adjust_lr {adjust_lr!r}; expected one of {ADJUST_LR_MODES}")
        if orthogonalizer is None:
            if use_gram_newton_schulz:  # dion's switch; ours runs on our Triton kernels
                orthogonalizer = "gram_newton_schulz"
            elif newton_schulz_func is not None:
                orthogonalizer = newton_schulz_func
            else:
                orthogonalizer = "polar_express" if use_polar_express else "newton_schulz5"
        if not callable(orthogonalizer) and orthogonalizer not in ORTHOGONALIZERS:
            raise ValueError(
                f"unknown orthogonalizer {orthogonalizer!r}; expected a callable or one of "
                f"{tuple(ORTHOGONALIZERS)}"
            )
        self.algorithms = {
            "muon": MuonUpdate(("momentum",), orthogonalizer),
            "adamw": AdamWUpdate(("momentum", "variance")),
            "lion": LionUpdate(("momentum",)),
        }
        defaults = dict(
            lr=lr,
            mu=mu,
            beta1=betas[0],
            beta2=betas[1],
            weight_decay=weight_decay,
            cautious_wd=cautious_wd,
            algorithm="muon",
            step=0,
            epsilon=epsilon,
            nesterov=nesterov,
            flatten=flatten,
            adjust_lr=adjust_lr,
        )
        super().__init__(params, defaults, distributed_mesh=distributed_mesh, **settings)

    @property
    def orthogonalizer(self):
        return self.algorithms["muon"].orthogonalizer

    @orthogonalizer.setter
    def orthogonalizer(self, method) -> None:
        self.algorithms["muon"].orthogonalizer = method

    def _read_hyper(self, group: dict, index: int) -> Hyper:
        hyper = read_hyper(group, index)
        if hyper.num_heads and getattr(self, "state_dtype", None) == torch.int8:
            # 8-bit momentum keeps one row of block scales a matrix of the parameter as created.
            raise NotImplementedError(
                f"param group {index}: num_heads > 1 with state_dtype=torch.int8 is not supported"
            )
        return hyper
