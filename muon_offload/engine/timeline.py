"""One step's stages, chunk by chunk, as the scheduler records them while ``timeline()`` is on.

Marks are kept in a list the optimizer hands the scheduler: per chunk and stage ("load",
"update", "store") a start and an end, CUDA events recorded on the stage's stream on the GPU
(read after a synchronize), ``perf_counter`` seconds on the CPU."""

from __future__ import annotations

import time

import torch


def start_stage(marks: list | None, chunk: int, stage: str, stream, cuda: bool):
    """Start ``stage`` of ``chunk``: the handle for ``end_stage``; None while nothing records."""
    if marks is None:
        return None
    if not cuda:
        marks.append([chunk, stage, time.perf_counter(), None])
        return marks[-1]
    start, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    marks.append((chunk, stage, start, finish))
    return finish


def end_stage(handle, stream) -> None:
    """End the stage ``start_stage`` began: its event on ``stream``, or the time now (CPU)."""
    if handle is None:
        return
    if isinstance(handle, list):
        handle[3] = time.perf_counter()
    else:
        handle.record(stream)


def stage_rows(marks: list, cuda: bool) -> list[dict]:
    """The marks as rows of ms from the earliest start (synchronize first on the GPU)."""
    if not marks:
        return []
    if cuda:
        ref = marks[0][2]
        spans = [(c, s, ref.elapsed_time(a), ref.elapsed_time(b)) for c, s, a, b in marks]
    else:
        spans = [(c, s, a * 1e3, b * 1e3) for c, s, a, b in marks]
    t0 = min(span[2] for span in spans)
    return [{"chunk": c, "stage": s, "start_ms": a - t0, "end_ms": b - t0} for c, s, a, b in spans]
