"""The engine under ``Muon`` and ``AdamW``: what a step runs through.

- ``optimizer.py``: ``ChunkedOptimizer``, the torch ``Optimizer`` that checks a step, creates
  state, plans it, and runs the chunks; algorithms plug in through ``algorithm.py``. It holds
  the parts that do the work, each handed what it reads (``_setup``), and its public methods
  of theirs forward to them (``delegated.py``).
- ``planner.py``: pure Python; cuts a step into units and chunks of ``chunk_bytes``;
  ``step_plans.py``: a step's plan with its transfers and layouts, cached.
- ``scheduler.py``: owns the side streams, events and staging arena; load, update, store;
  ``streams.py``: the optimizer's scheduler, made for the step's device.
- ``state.py`` / ``host_slabs.py``: where state lives, and its creation (``StateBuilder``);
  pinned host slabs allocated once.
- ``settings.py``: the constructor settings: checked, defaulted and documented once.
- ``group_checks.py`` / ``step_work.py``: the generic checks of groups, parameters and
  gradients, and a step's checked (group, parameter) pairs; each runs before anything is touched.
- ``chunks.py``: one chunk's state in order, its units run as tasks.
- ``introspect.py``: the small surface tools read (host bytes, staging, timeline).
- ``graph_runner.py``: a step's GPU work, eager or through the CUDA graphs (``graphs.py``).
- ``prefetch.py``: the next step's first loads ahead of it, from a backward hook.
- ``checkpoint.py``: ``load_state_dict``'s checks and copies.
- ``saved_groups.py``: a loaded state dict's structure and groups, checked first.
- ``interrupt.py``: what a step stopped by an exception updated (``StepInterrupted``).
- ``algorithm.py``: what the engine asks of an algorithm (its update, scalars, budget rule,
  backends); each algorithm and its launchers live in ``optim/`` (``optim/muon_launch.py``,
  ``optim/elementwise.py``).
"""

from .optimizer import ChunkedOptimizer
from .settings import DEFAULT_CHUNK_BYTES, DEFAULT_RESIDENT_CHUNK_BYTES

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_RESIDENT_CHUNK_BYTES", "ChunkedOptimizer"]
