"""CUDA graphs and meshes on the CPU (gloo processes, as tests/test_distributed.py): which
meshes a graph may capture (engine/capture_rules.py: NCCL's collectives, not gloo's), the
graph key of a step with DTensor parameters (engine/graphs.py), and replays of a sharded
step's launches and collectives (tests/_graph_emulator.py) equal to eager steps, with ranks
that capture at different steps. Captured steps on a GPU: tests/test_gpu_graph_mesh.py."""

import _processes
import dist_workers_graph
import pytest

pytestmark = pytest.mark.distributed


def test_gloo_meshes_stay_eager_nccl_meshes_pass_the_rule():
    _processes.run(dist_workers_graph.rule_decisions, 2)


def test_dtensor_steps_have_a_graph_key_of_their_shards():
    _processes.run(dist_workers_graph.dtensor_key, 2)


def test_replayed_collectives_equal_eager_steps_ranks_capturing_apart():
    _processes.run(dist_workers_graph.replay_equals_eager, 2, timeout=300)


def test_dtensor_gradient_table_equals_own_addresses():
    _processes.run(dist_workers_graph.table_against_own_addresses, 2, timeout=300)
