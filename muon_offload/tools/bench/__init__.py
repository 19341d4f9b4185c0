"""``muon-offload bench``, in parts:

- ``command``: its options, the run from bandwidth to the last mode, and ``main``;
- ``modes``: what is timed on one copy of a workload (ours resident and offloaded, the
  all-at-once baseline, torch's fused AdamW, the state_dict cost, one step's timeline);
- ``dion_runner``: dion's ``Muon`` timed in a subprocess;
- ``timing``: ``Clock``, ``time_steps``, ``bandwidths``, the transfer floor;
- ``report``: the terminal table and its row formatting; ``figures``: the PNGs;
- ``machine``: the card and versions recorded with the figures; ``progress``: stage lines.

``timing``, ``report``, ``machine``, ``progress`` and ``dion_runner`` serve the scripts in
``bench/`` too.
"""
