"""The tools around the optimizer: the ``muon-offload`` command (``cli``: ``demo``, ``bench``,
``tune``) and the named workloads they step (``workloads``).

``import muon_offload`` does not load them. They use only the optimizer's public surface
(``host_buffers()``, ``reconfigure()``, ``timeline()``, ...), as a user's script would.
"""
