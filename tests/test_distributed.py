"""Distributed Muon: several processes over gloo on CPUs (CI), or over NCCL with one GPU each
when MUON_OFFLOAD_TEST_BACKEND=nccl (see dist_workers.py)."""

import _processes
import pytest
import torch.multiprocessing as mp

import dist_workers

pytestmark = pytest.mark.distributed


def _spawn(fn, world, *args):
    _processes.run(fn, world, *args)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_and_replicated_step(world):
    _spawn(dist_workers.equivalence, world)


def test_a_step_on_a_mesh_keeps_its_ends():
    _spawn(dist_workers.mesh_keeps_its_ends, 2)


def test_sharded_exchange_needs_no_list_all_to_all():
    _spawn(dist_workers.without_list_all_to_all, 2)


def test_packed_parameter_updated_once_with_tiny_chunks():
    _spawn(dist_workers.packed_once, 2)


def test_fsdp2_fully_shard():
    _spawn(dist_workers.fsdp2, 2)


def test_mismatched_inputs_fail_before_any_step():
    _spawn(dist_workers.mismatches, 2)


def test_two_sharded_dims_refused():
    _spawn(dist_workers.two_sharded_dims, 4)


def test_num_heads_sharded_on_heads_and_replicated():
    _spawn(dist_workers.heads, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_against_dion(world):
    pytest.importorskip(
        "dion",
        reason='needs dion, which is not on PyPI: pip install "git+https://github.com/microsoft/dion@0a059a4"',
    )
    try:
        _spawn(dist_workers.against_dion, world)
    except mp.ProcessRaisedException as err:
        # dion's Muon exchanges with the list-form all_to_all, which gloo has only from
        # pytorch PR 165435 (2026-04; torch 2.11 lacks it). Ours does not need it.
        if "does not support alltoall" in str(err):
            pytest.skip("dion needs gloo's list-form all_to_all (torch >= 2.12)")
        raise


def test_world_of_one_equals_plain_step():
    _spawn(dist_workers.world_of_one, 1)


def test_distributed_checkpoint_resumes_bitwise(tmp_path):
    _spawn(dist_workers.dcp_resume, 2, str(tmp_path / "ckpt"))
