"""bench/eager_host_meta.py on the CPU: an eager step of one full-width layer of
training_loop.py's MoE model on meta tensors, its Triton launches counted (none run) and its
host time estimated."""

import pytest
from _bench_import import import_bench

pytest.importorskip("transformers", reason='needs transformers: pip install -e ".[hf]"')
pytest.importorskip("triton")
(eager_host_meta,) = import_bench("eager_host_meta")


@pytest.fixture(scope="module")
def rows():
    return {m: eager_host_meta.run("moe", m, 1, 1) for m in ("ours_resident", "ours_offload_int8")}


def test_launches_follow_the_state_format(rows):
    resident, int8 = (
        rows["ours_resident"]["launches_by_kernel"],
        rows["ours_offload_int8"]["launches_by_kernel"],
    )
    assert resident.get("_muon_prep_kernel", 0) > 0 and "_prep8_kernel" not in resident
    assert int8.get("_prep8_kernel", 0) > 0 and "_muon_prep_kernel" not in int8
    for row in rows.values():
        assert row["triton_launches"] == sum(row["launches_by_kernel"].values())
        assert row["aten_ops"] > 0 and 0 < row["python_share"] <= 1
        assert 0 < row["min_ms"] <= row["wall_ms"]


def test_streamed_chunks_cut_no_fewer_units(rows):
    # An eager 8-bit step's streamed chunks (1 GiB at fp32 width) are no larger than the
    # eager resident budget (1 GiB): the same matrices in no fewer units, so no fewer Muon preps.
    resident = rows["ours_resident"]["launches_by_kernel"]["_muon_prep_kernel"]
    assert rows["ours_offload_int8"]["launches_by_kernel"]["_prep8_kernel"] >= resident


def test_estimate_adds_the_launch_costs(rows):
    row = rows["ours_resident"]
    python = row["min_ms"] * row["python_share"]
    assert eager_host_meta.estimate(row, 0.0, 0.0) == pytest.approx(python)
    more = eager_host_meta.estimate(row, 10.0, 2.0) - python
    assert more == pytest.approx((10.0 * row["triton_launches"] + 2.0 * row["aten_ops"]) / 1e3)
