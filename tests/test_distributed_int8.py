"""8-bit state (``state_dtype=torch.int8``) of DTensor (FSDP2) parameters, on several gloo
processes (tests/dist_workers_int8.py; NCCL with MUON_OFFLOAD_TEST_BACKEND=nccl)."""

import dist_workers_int8 as workers
import pytest
from test_rank_agreement import _spawn

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [1, 2, 3])
def test_steps_against_one_process(world):
    _spawn(workers.equivalence, world)


def test_distributed_checkpoints_resume_bitwise_and_convert(tmp_path):
    _spawn(workers.checkpoints, 2, str(tmp_path / "ckpt"))


def test_bad_input_and_refusals():
    _spawn(workers.bad_input, 2)


def test_checkpoint_moves_to_another_world_size_through_dense_state(tmp_path):
    _spawn(workers.move_world_size, 2, str(tmp_path / "ckpt"), "save")
    _spawn(workers.move_world_size, 1, str(tmp_path / "ckpt"), "load")
