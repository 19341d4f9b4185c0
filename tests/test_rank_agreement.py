"""Every rank of a mesh must step the same parameters
(muon_offload/distributed/rank_agreement.py). Gloo processes on CPUs, as
tests/test_distributed.py."""

import json

import _processes
import pytest

from muon_offload.distributed.rank_agreement import fingerprint

import dist_workers

pytestmark = pytest.mark.distributed


def _spawn(fn, world, *args, timeout=180):
    _processes.run(fn, world, *args, timeout=timeout)


def test_fingerprint_is_deterministic():
    # Fixed across processes and runs (blake2b, not the salted hash()); int64 both ways.
    assert fingerprint([]) == fingerprint(())
    assert fingerprint([0, 3, 7]) != fingerprint([0, 3])
    assert fingerprint([0, 3, 7]) != fingerprint([0, 7, 3])
    assert 0 <= fingerprint(range(1000)) < 2**63
    # The gradients' dtypes count: the step batches matrices by gradient dtype.
    assert fingerprint([0, 3], ["torch.float32"] * 2) != fingerprint([0, 3])
    f32, bf16 = "torch.float32", "torch.bfloat16"
    assert fingerprint([0, 3], [f32, bf16]) != fingerprint([0, 3], [bf16, f32])


@pytest.mark.parametrize("world", [2, 3])
def test_disagreement_raises_on_every_rank(world):
    _spawn(dist_workers.agreement_direct, world)


def test_nccl_like_groups_get_gloo_twins_over_their_ranks():
    _spawn(dist_workers.agreement_twins, 4)


def test_cost_per_step(tmp_path):
    path = tmp_path / "cost.json"
    _spawn(dist_workers.agreement_cost, 2, str(path))
    cost = json.loads(path.read_text())
    print("\nStepAgreement.check, 2 gloo processes on the CPU:", cost)
    # A measurement, not a target (speed targets live in bench/): it ran and was recorded.
    assert cost["200"]["check_us_median"] > 0


def test_muon_gradient_none_on_one_rank_raises_before_anything_moves():
    _spawn(dist_workers.agreement_muon_none_on_one_rank, 2, timeout=120)


def test_muon_agreed_steps_unchanged_by_the_check():
    _spawn(dist_workers.agreement_muon_agreed, 2)
