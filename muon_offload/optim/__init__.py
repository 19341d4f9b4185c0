"""The algorithms and their optimizers, over the engine (``engine/``), which knows no update rule.

- ``muon.py``: ``Muon`` (dion's constructor and keys) and ``MuonUpdate``, a Muon unit's work;
  ``muon_launch.py`` its launchers, ``muon_shapes.py`` a parameter's matrices and dion's lr
  adjustment.
- ``adamw.py``: ``AdamW`` (torch's constructor, keys and checkpoints).
- ``elementwise.py``: ``AdamWUpdate`` and ``LionUpdate``, an element-wise unit's work, and
  their launchers.
- ``hyper.py``: each algorithm's hyper-parameters read from a param group.
- ``param_groups.py``: ``muon_param_groups``, a model's parameters split into groups.

Nothing is imported here: the package's public names load their modules on first use
(``muon_offload/__init__.py``).
"""
