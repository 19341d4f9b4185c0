"""Fused kernels and the torch references they are tested against.

Installed as ``muon_offload.kernels``. Each module holds one kernel family: its Triton
kernels and typed launchers (used for CUDA tensors) beside the plain-torch reference
(used on the CPU, and as the thing every kernel is checked against).
"""
