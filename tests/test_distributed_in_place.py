"""An FSDP2 checkpoint loaded in place into the live state dicts on several gloo processes
(tests/dist_workers_in_place.py; NCCL with MUON_OFFLOAD_TEST_BACKEND=nccl)."""

import dist_workers_in_place as workers
import pytest
from test_rank_agreement import _spawn

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_in_place_load_resumes_bitwise(state_dtype, offload, tmp_path):
    _spawn(workers.in_place_resume, 2, str(tmp_path / "ckpt"), state_dtype, offload)
