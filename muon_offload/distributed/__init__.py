"""Meshes, placements and collectives (``collectives.py``), and the per-step check that the
ranks of a mesh step the same parameters (``rank_agreement.py``): what the engine and the
algorithms import of them, in one place."""

from .collectives import (
    LOCAL,
    DTensor,
    Mesh,
    Placement,
    check_ranks_agree,
    dtensor_around,
    dtensor_of,
    local,
    orthogonalize_replicated,
    orthogonalize_sharded,
    placement_of,
    resolve_mesh,
    run_tasks,
    sharded_dims,
)
from .rank_agreement import StepAgreements

__all__ = [
    "LOCAL",
    "DTensor",
    "Mesh",
    "Placement",
    "StepAgreements",
    "check_ranks_agree",
    "dtensor_around",
    "dtensor_of",
    "local",
    "orthogonalize_replicated",
    "orthogonalize_sharded",
    "placement_of",
    "sharded_dims",
    "resolve_mesh",
    "run_tasks",
]
