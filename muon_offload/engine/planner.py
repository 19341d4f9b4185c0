"""The chunk planner: pure Python, no tensors, so it is tested without a GPU.

A step's work is cut into *units*, and units are packed into *chunks* of at most
``chunk_bytes`` of optimizer state, the amount that crosses PCIe together. The planner knows
no algorithm by name: each parameter says whether its algorithm is element-wise
(``ParamInfo.elementwise``, from ``Algorithm.elementwise``).

- A matrix unit (``MatrixUnit``) batches parameters of a non-element-wise algorithm (Muon)
  that share a ``batch_key`` (shape, dtype, state format, placement): for Muon, the batch
  that is orthogonalized together. Units are filled to the budget: a parameter that fits
  the room left goes whole; a stack of matrices (``ParamInfo.matrices`` > 1) that does not
  is cut at matrix boundaries into pieces (``Matrices``), the first filling that room, the
  next ones a whole budget each. Every unit of a batch but its last is then full, so a step
  issues as few batches (launches) as the budget allows (the MoE expert stacks of 192 MiB
  went 2 to a 512 MiB unit, 2.67 now), and no load is larger than a chunk, so each overlaps
  an update like any other chunk's. Each matrix is still in exactly one unit, and Muon
  orthogonalizes every matrix of a stack on its own, so the cut changes no result. Any
  other parameter goes whole into the next unit: a single matrix is never cut
  (orthogonalization needs the whole of it), nor a packed parameter (dion's
  ``split_sizes``: row blocks of one matrix).
- Element-wise (adamw, lion) state has no structure to respect, so a parameter is cut
  anywhere (on a multiple of SEGMENT_ALIGN elements) into segments, and no chunk is forced
  over budget by a large embedding. A streamed chunk may hold less of it than its budget
  (``elementwise_chunk_bytes``, ``Settings.elementwise_chunk_bytes``): an element-wise unit
  is one launch whatever its size, and where matrix state is budgeted wider than it stages
  (8-bit Muon at fp32 width) a full budget of element-wise state would size the staging.
- A single matrix larger than ``chunk_bytes`` (a 2-D parameter, or one matrix of a stack)
  becomes a unit and a chunk of its own.
- Within each part (resident, streamed) matrix units are packed first, then element-wise
  parameters; a streamed chunk holds one kind only (a resident one may hold both). A plan
  lists its chunks in the order they run: the resident ones first, as packed; then the
  streamed ones, with the chunks that hold only element-wise units spread among those that
  hold matrix units (``interleave``), so that the arithmetic of the matrix chunks (Muon's
  orthogonalization) hides the transfers of element-wise ones, which have almost no
  arithmetic. ``elementwise_only`` names the chunks that hold no matrix unit: the scheduler
  runs their updates on a stream of their own, beside the matrix chunks' (scheduler.py).
- A step's plan then has the streamed matrix chunks at its two ends halved at matrix
  boundaries (taper.py): the first chunk's load and the last chunk's store are what no
  update hides.
- State that stays on the GPU (resident) crosses no bus, so its chunks only sequence the
  work: they take their own budget, ``resident_chunk_bytes``, larger by default (settings.py),
  so that matrix batches are larger and a resident step issues fewer launches.

Budgets are counted in ``plan_bytes``: a parameter's state bytes computed from its *global*
size divided by the mesh size, identical on every rank, so under sharding every rank cuts
the same units into the same chunks (never cut on local shard sizes). Matrix state narrower
than fp32 (bf16, 8-bit) counts as fp32 (``StateBuilder.budget_bytes``): a matrix chunk's GPU work
buffers (Muon's) grow with its matrices, whatever the state's width.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

# Element-wise cuts fall on multiples of this many elements, so every segment of a parameter
# and of its state starts 16-byte aligned (fp32 and bf16 alike) and the kernels keep their
# vector loads; a chunk may go over budget by less than this many elements' state.
SEGMENT_ALIGN = 64


@dataclass(frozen=True)
class ParamInfo:
    """What the planner needs to know of one parameter that has a gradient this step."""

    index: int  # position in the optimizer's flat parameter order
    group: int
    algorithm: str  # the name of the group's algorithm (the optimizer's ``algorithms`` key)
    numel: int  # local elements (the shard on this rank)
    plan_bytes: int  # bytes for budgeting: global state bytes (matrix: at least fp32) / mesh size
    # Matrix parameters: (shape, dtype, gradient dtype, state format, placement); they batch
    # only if equal (a batch is one launch, reading one gradient dtype).
    batch_key: Hashable = None
    resident: bool = True  # state kept on the GPU (never streamed)
    # Element-wise cuts fall on multiples of this many elements: SEGMENT_ALIGN, or a multiple
    # of the quantization block for 8-bit state, so no block spans two chunks.
    align: int = SEGMENT_ALIGN
    # Element-wise parameters share a unit only with the same key (the state format): one
    # unit is one kernel's work.
    unit_key: Hashable = None
    # Matrix parameters: how many equal matrices it may be cut into at their boundaries (a
    # stack's: ``Algorithm.matrices``), when its state is over budget; 1 keeps it whole.
    # Set from shapes and settings alone, so every rank cuts the same pieces.
    matrices: int = 1
    # Whether the algorithm may see the parameter cut into segments (``Algorithm.elementwise``):
    # False makes it a matrix parameter, kept whole and batched by ``batch_key``. Required, so
    # that no caller gets one kind by default.
    elementwise: bool = field(kw_only=True)


@dataclass(frozen=True)
class Matrices:
    """Matrices [start, stop) of a stack (the parameter seen as ``(matrices, rows, cols)``)."""

    start: int
    stop: int


@dataclass(frozen=True)
class MatrixUnit:
    """Parameters of one group, batched by ``ParamInfo.batch_key`` (a Muon batch): each whole,
    or for a stack cut at matrix boundaries, the piece ``pieces[k]`` of ``params[k]``."""

    group: int
    algorithm: str
    params: tuple[int, ...]
    plan_bytes: int
    pieces: tuple[Matrices | None, ...] = ()  # one an item (None: whole); (): every one whole

    def piece(self, k: int) -> Matrices | None:
        return self.pieces[k] if self.pieces else None


@dataclass(frozen=True)
class Segment:
    param: int
    start: int  # element range [start, stop) of the flattened local tensor
    stop: int


@dataclass(frozen=True)
class ElementwiseUnit:
    group: int
    algorithm: str
    segments: tuple[Segment, ...]
    plan_bytes: int
    key: Hashable = None  # the ParamInfo.unit_key its parameters share


Unit = MatrixUnit | ElementwiseUnit


def unit_params(unit: Unit) -> list[int]:
    """The parameter indices a unit updates (an element-wise one may list one several times)."""
    if isinstance(unit, MatrixUnit):
        return list(unit.params)
    return [s.param for s in unit.segments]


@dataclass(frozen=True)
class Chunk:
    units: tuple[Unit, ...]
    plan_bytes: int
    resident: bool


@dataclass(frozen=True)
class Plan:
    chunks: tuple[Chunk, ...]
    # Streamed matrix parameters of which one piece that cannot be cut further (a matrix, or
    # a stack kept whole) exceeds chunk_bytes: each such piece got a chunk of its own.
    oversized: tuple[int, ...] = ()

    def units(self):
        return [u for c in self.chunks for u in c.units]


def plan_step(
    params: Sequence[ParamInfo],
    chunk_bytes: int,
    resident_chunk_bytes: int,
    elementwise_chunk_bytes: int | None = None,
) -> Plan:
    """Cut the step's parameters into units and pack the units into chunks: streamed ones
    within ``chunk_bytes``, of which at most ``elementwise_chunk_bytes`` (default:
    ``chunk_bytes``) of element-wise state, resident ones within ``resident_chunk_bytes``
    (positive ints, as ``Settings`` holds them).

    Resident chunks come first. Within each part, units are packed matrix units first, then
    element-wise parameters; groups keep their order, matrix units keep their parameters'
    first-seen order, and element-wise parameters keep theirs. The streamed chunks then run in
    ``interleave``'s order; the resident ones run as packed (they cross no bus, so there is
    nothing to hide).
    """
    chunks: list[Chunk] = []
    oversized: list[int] = []
    for resident in (True, False):
        part = [p for p in params if p.resident == resident]
        budget = resident_chunk_bytes if resident else chunk_bytes
        # Resident chunks stage nothing: only a streamed one's element-wise share is held.
        elementwise = (
            budget if resident or elementwise_chunk_bytes is None else elementwise_chunk_bytes
        )
        packer = _Packer(budget, resident, min(budget, elementwise))
        # Only a streamed parameter over budget is worth a notice: it sizes the staging arena.
        for item in _units_in_order(part, budget, [] if resident else oversized):
            if isinstance(item, MatrixUnit):
                packer.add_matrix(item)
                continue
            if not resident and packer.units and isinstance(packer.units[-1], MatrixUnit):
                # A streamed chunk of both kinds ran last (the element-wise parameters fill
                # the last matrix chunk's room) and on the compute lane: its element-wise
                # transfers, long against their update, were the step's unhidden end (125 MiB
                # of AdamW state in a Qwen3-MoE step). Alone, they run among the others.
                packer.close()
            packer.add_elementwise(item)
        packed = packer.finish()
        chunks.extend(packed if resident else interleave(packed))
    return Plan(tuple(chunks), tuple(oversized))


def holds_matrices(chunk: Chunk) -> bool:
    """Whether a chunk holds matrix units: its update is compute-bound (Muon's matrix
    products) and, under sharding, issues collectives."""
    return any(isinstance(u, MatrixUnit) for u in chunk.units)


def elementwise_only(plan: Plan) -> tuple[bool, ...]:
    """Per chunk of ``plan``, in run order: whether it holds no matrix unit. Such a chunk
    issues no collective and its update is memory-bound (no matrix products), so it may run
    beside the matrix chunks' compute-bound updates (the scheduler's side stream). A chunk that
    holds both (resident: the element-wise units packed into the last matrix chunk) counts as
    a matrix chunk."""
    return tuple(not holds_matrices(c) for c in plan.chunks)


def interleave(chunks: list[Chunk]) -> list[Chunk]:
    """The order streamed chunks run in: the chunks that hold matrix units in their packed
    order, with the element-wise-only chunks (in their packed order) spread among them.

    Why: a matrix chunk is compute-bound (Muon's orthogonalization outlasts the next chunk's
    load); an element-wise chunk is almost pure transfer. Run after all the matrix chunks (the
    packed order), the element-wise ones made an unhidden tail of loads and stores
    (llama3-8b-fsdp8-rank on an H200: ~1 GB of AdamW state each way, 0.137 s offloaded
    against 0.116 s resident and a 0.094 s transfer floor). Spread out, their transfers run
    under the matrix chunks' arithmetic.

    Rule (integers only, so deterministic): each matrix chunk weighs its matrix units'
    plan_bytes, each element-wise-only chunk its plan_bytes (at least 1 each). Element-wise
    chunk j runs right after the first matrix chunk by which the matrix share issued,
    sum(matrix weights so far) / sum(matrix weights), reaches the midpoint of chunk j's
    element-wise share, (weights before j + weight j / 2) / sum(element-wise weights). So the
    element-wise bytes issued stay proportional to the matrix bytes issued, to within half an
    element-wise chunk after each matrix chunk; none runs before the first matrix chunk, and
    after the last only about half a share.

    Under sharding this is safe: matrix units are packed before element-wise parameters, on
    global sizes (plan_bytes), so every rank has the same matrix-holding chunks with the same
    matrix units, and they keep their relative order here: every rank issues the same
    collectives in the same order (``distributed.run_tasks`` issues them in task order,
    ``chunks.run_chunk`` runs a chunk's units in order). Element-wise units issue no
    collective; their chunks are cut on local sizes, so their number and place may differ
    by rank. The weights of matrix chunks count matrix units only, equal on every rank (a
    streamed chunk holds no element-wise unit beside them). With no matrix chunk,
    or no element-wise-only chunk, the order is the packed one. Chunks are independent (each
    updates its own parameters' elements), so the order changes no result.
    """
    matrix = [c for c in chunks if holds_matrices(c)]
    others = [c for c in chunks if not holds_matrices(c)]
    if not matrix or not others:
        return chunks
    m_weights = [
        max(1, sum(u.plan_bytes for u in c.units if isinstance(u, MatrixUnit))) for c in matrix
    ]
    e_weights = [max(1, c.plan_bytes) for c in others]
    m_total, e_total = sum(m_weights), sum(e_weights)
    order: list[Chunk] = []
    j = e_before = m_done = 0
    for chunk, weight in zip(matrix, m_weights, strict=True):
        order.append(chunk)
        m_done += weight
        # (e_before + e_weights[j] / 2) / e_total <= m_done / m_total, times 2 * totals.
        while j < len(others) and (2 * e_before + e_weights[j]) * m_total <= 2 * m_done * e_total:
            order.append(others[j])
            e_before += e_weights[j]
            j += 1
    return order  # the last matrix chunk has m_done == m_total: every chunk was placed


def _units_in_order(params: Sequence[ParamInfo], chunk_bytes: int, oversized: list[int]):
    """Yield matrix units (groups in order), then element-wise ParamInfos (groups in order).

    Matrix units are packed first so that under sharding, where element-wise parameters are
    cut on local sizes, the matrix units (and so the collectives) fall into the same chunks
    on every rank (``interleave`` then changes the order chunks run in, not their
    contents). A group has one algorithm, so its first member says whether it is element-wise."""
    groups: dict[int, list[ParamInfo]] = {}
    for p in params:
        groups.setdefault(p.group, []).append(p)
    for members in groups.values():
        if members[0].elementwise:
            continue
        group, algorithm = members[0].group, members[0].algorithm
        buckets: dict[Hashable, list[ParamInfo]] = {}
        for p in members:
            buckets.setdefault(p.batch_key, []).append(p)
        for bucket in buckets.values():
            unit: list[tuple[int, Matrices | None]] = []
            unit_bytes = 0
            for p in bucket:
                for piece, nbytes in _pieces(p, chunk_bytes, chunk_bytes - unit_bytes):
                    if unit and unit_bytes + nbytes > chunk_bytes:
                        yield matrix_unit(group, algorithm, unit, unit_bytes)
                        unit, unit_bytes = [], 0
                    unit.append((p.index, piece))
                    unit_bytes += nbytes
                    if nbytes > chunk_bytes and p.index not in oversized[-1:]:
                        oversized.append(p.index)
            if unit:
                yield matrix_unit(group, algorithm, unit, unit_bytes)
    for members in groups.values():
        if members[0].elementwise:
            yield from members


def _pieces(p: ParamInfo, chunk_bytes: int, room: int) -> list[tuple[Matrices | None, int]]:
    """(piece, plan bytes) of a matrix parameter, with ``room`` bytes left in the unit being
    filled: itself whole where it fits there or cannot be cut; a stack otherwise in runs of
    whole matrices, the first filling the room and each further one a whole budget (the last
    the rest), so that a bucket's units are full and a step issues as few batches as the
    budget allows. A matrix alone over budget is a piece of its own. Integers only, from the
    planner's inputs alone: the same pieces on every rank."""
    total, count = p.plan_bytes, p.matrices
    if count <= 1 or total <= room:
        return [(None, total)]
    out, start = [], 0
    while start < count:
        # The most matrices from ``start`` whose share of plan_bytes,
        # total * stop // count - total * start // count, is at most ``room``.
        stop = min(count, ((room + total * start // count + 1) * count - 1) // total)
        if stop <= start:  # not one matrix fits the room
            if room < chunk_bytes:  # the unit has something: the next one starts empty
                room = chunk_bytes
                continue
            stop = start + 1  # one matrix over budget, a piece of its own
        nbytes = total * stop // count - total * start // count
        out.append((Matrices(start, stop), nbytes))
        start, room = stop, chunk_bytes
    if len(out) == 1:
        return [(None, total)]
    return out


def matrix_unit(group: int, algorithm: str, items: list, nbytes: int) -> MatrixUnit:
    """A unit of (parameter index, piece) items; whole parameters only: no ``pieces``."""
    pieces = tuple(piece for _, piece in items)
    return MatrixUnit(
        group,
        algorithm,
        tuple(i for i, _ in items),
        nbytes,
        pieces if any(pieces) else (),
    )


@dataclass
class _Packer:
    chunk_bytes: int
    resident: bool
    elementwise_bytes: int  # element-wise state a chunk holds at most (<= chunk_bytes)
    chunks: list[Chunk] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    used: int = 0
    elementwise_used: int = 0

    def close(self) -> None:
        if self.units:
            self.chunks.append(Chunk(tuple(self.units), self.used, self.resident))
        self.units, self.used, self.elementwise_used = [], 0, 0

    def add_matrix(self, unit: MatrixUnit) -> None:
        if self.units and self.used + unit.plan_bytes > self.chunk_bytes:
            self.close()
        self.units.append(unit)
        self.used += unit.plan_bytes

    def add_elementwise(self, p: ParamInfo) -> None:
        # Bytes per element, rounded up so a chunk's byte count never exceeds its budget.
        per_elem = max(1, -(-p.plan_bytes // max(p.numel, 1)))
        start = 0
        while start < p.numel:
            left = min(self.chunk_bytes - self.used, self.elementwise_bytes - self.elementwise_used)
            room = max(0, left) // per_elem
            if room < p.numel - start:
                room -= room % p.align
            if room == 0:
                self.close()
                room = max(p.align, self.elementwise_bytes // per_elem)
                if room < p.numel - start:
                    room -= room % p.align
            stop = min(p.numel, start + room)
            self._append_segment(p, Segment(p.index, start, stop), (stop - start) * per_elem)
            start = stop

    def _append_segment(self, p: ParamInfo, segment: Segment, nbytes: int) -> None:
        last = self.units[-1] if self.units else None
        if isinstance(last, ElementwiseUnit) and (last.group, last.key) == (p.group, p.unit_key):
            self.units[-1] = ElementwiseUnit(
                p.group, p.algorithm, (*last.segments, segment), last.plan_bytes + nbytes, last.key
            )
        else:
            self.units.append(ElementwiseUnit(p.group, p.algorithm, (segment,), nbytes, p.unit_key))
        self.used += nbytes
        self.elementwise_used += nbytes

    def finish(self) -> list[Chunk]:
        self.close()
        return self.chunks
