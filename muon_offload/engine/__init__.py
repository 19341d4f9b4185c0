"""The engine under ``Muon`` and ``AdamW``: what a step runs through.

- ``optimizer.py``: ``ChunkedOptimizer``, the torch ``Optimizer`` that checks a step, creates
  state, plans it, and runs the chunks; algorithms plug in through ``algorithm.py``.
- ``planner.py``: pure Python; cuts a step into units and chunks of ``chunk_bytes``.
- ``scheduler.py``: owns the side streams, events and staging ring; load, update, store.
- ``state.py`` / ``host_slabs.py``: where state lives; pinned host slabs allocated once.
- ``checkpoint.py``: ``load_state_dict``'s checks and copies.
- ``interrupt.py``: what a step stopped by an exception updated (``StepInterrupted``).
- ``dispatch.py``: the fused Triton kernels on CUDA, their torch references elsewhere.
"""

from .optimizer import DEFAULT_CHUNK_BYTES, DEFAULT_RESIDENT_CHUNK_BYTES, ChunkedOptimizer

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_RESIDENT_CHUNK_BYTES", "ChunkedOptimizer"]
