"""The bench's 8-bit state modes and its torchao peer, on the CPU: the 8-bit mode's host bytes
follow the state format (codes and block scales, small tensors dense fp32), its floor comes
from them; ``--torchao-offload`` is refused with a usage error where it cannot run; the
AdamW-only workloads and the hyper-parameters every AdamW peer shares."""

import importlib.machinery
import subprocess
import sys
import types
from argparse import Namespace

import pytest
import torch

from muon_offload.engine.host_slabs import ALIGN_BYTES
from muon_offload.engine.state_format import StatePolicy
from muon_offload.tools import cli
from muon_offload.tools.bench.modes import TORCH_ADAMW, accumulate_grads, build, run_modes
from muon_offload.tools.bench.runner import add_floors
from muon_offload.tools.bench.timing import GIB, Clock
from muon_offload.tools.workloads import ADAMW_ONLY, ParamSpec, workload

NEEDS_NO_GPU = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU"
)
# Each format on each algorithm: 64x80 and 70x90 and 4100 hold >= 4096 elements (8-bit codes
# and scales, a block cut short at the end), 33x70 and 96 stay dense fp32.
SPECS = [
    ParamSpec("w", (64, 80), "muon"),
    ParamSpec("odd", (33, 70), "muon"),
    ParamSpec("emb", (70, 90), "adamw"),
    ParamSpec("long", (4100,), "adamw"),
    ParamSpec("norm", (96,), "adamw"),
]


def _host_bytes_from_format(specs, state_dtype) -> tuple[int, int]:
    """(the bytes the state format gives the workload's state, how many host tensors hold
    it): each tensor starts on an ALIGN_BYTES boundary, so the host slabs hold at most
    ALIGN_BYTES - 1 more a tensor."""
    policy = StatePolicy(state_dtype)
    nbytes = tensors = 0
    for s in specs:
        keys = 1 if s.algorithm == "muon" else 2
        fmt = policy.format_for(torch.empty(s.shape))
        nbytes += fmt.nbytes(s.numel, keys)
        tensors += keys * len(fmt.names("state"))
    return nbytes, tensors


@pytest.fixture(scope="module")
def modes():
    args = Namespace(device="cpu", offload_only=False, chunk_bytes=4096, chunk_mib=[])
    clock = Clock(torch.device("cpu"))
    return run_modes(SPECS, args, clock, lambda stage: None, warmup=1, steps=1, full=True)


def test_int8_modes_run_and_report_host_bytes_of_codes_and_scales(modes):
    for mode in ("ours_offload_int8", "ours_resident_int8"):
        assert modes[mode]["median_s"] > 0 and modes[mode]["steps"] == 1, mode
    assert "host_state_gib" not in modes["ours_resident_int8"]  # nothing streamed
    for mode, dtype in (("ours_offload_fp32", torch.float32), ("ours_offload_int8", torch.int8)):
        expected, tensors = _host_bytes_from_format(SPECS, dtype)
        host = modes[mode]["streamed_bytes"]
        assert expected <= host < expected + ALIGN_BYTES * tensors, mode
        assert modes[mode]["host_state_gib"] == host / GIB
    # A quarter of fp32's bytes plus the scales, less where small tensors stay fp32.
    fp32, _ = _host_bytes_from_format(SPECS, torch.float32)
    int8, _ = _host_bytes_from_format(SPECS, torch.int8)
    assert fp32 / 4 < int8 < fp32 / 2


def test_floor_from_the_streamed_bytes(modes):
    offloaded = {k: dict(modes[k]) for k in ("ours_offload_fp32", "ours_offload_int8")}
    add_floors(offloaded, {"both_each": 40.0})
    for m in offloaded.values():
        assert m["floor_s"] == m["streamed_bytes"] / 40e9
    add_floors(offloaded, None)  # no GPU: not measured
    assert all(m["floor_s"] is None for m in offloaded.values())


def test_adamw_peers_share_our_hyper_parameters():
    specs = [ParamSpec("a", (300,), "adamw")]
    (group,), _, _ = build(specs, torch.device("cpu"))
    ours = (group["lr"], (group["beta1"], group["beta2"]), group["epsilon"], group["weight_decay"])
    theirs = (TORCH_ADAMW["lr"], TORCH_ADAMW["betas"], TORCH_ADAMW["eps"])
    assert ours == (*theirs, TORCH_ADAMW["weight_decay"])
    torch_opt = torch.optim.AdamW(group["params"], **TORCH_ADAMW)
    assert torch_opt.param_groups[0]["betas"] == ours[1]


def test_adamw_only_workloads():
    assert sorted(ADAMW_ONLY) == ["llama3-8b-fsdp8-rank-adamw", "tiny-adamw"]
    mixed, adamw = workload("llama3-8b-fsdp8-rank"), workload("llama3-8b-fsdp8-rank-adamw")
    assert [(s.name, s.shape) for s in mixed] == [(s.name, s.shape) for s in adamw]
    assert {s.algorithm for s in adamw} == {"adamw"}
    assert sum(s.numel for s in adamw) == 1_003_786_240


def test_grad_hand_off_fires_hooks_and_keeps_gradients():
    """The torchao mode's stand-in for backward: each parameter's post-accumulate-grad hook
    runs once a step, and the gradients keep their values and storage."""
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in params]
    storage = [p.grad.data_ptr() for p in params]
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: fired.append(q))
    zeros = [torch.zeros(()).expand_as(p) for p in params]
    accumulate_grads(params, zeros)
    assert [id(q) for q in fired] == [id(p) for p in params]
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    assert [p.grad.data_ptr() for p in params] == storage


def _refusal(args, tmp_path, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *args, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: muon-offload bench")
    assert not (tmp_path / "bench.json").exists()
    return err


@NEEDS_NO_GPU
@pytest.mark.parametrize("installed", [True, False])
def test_torchao_refused_without_a_gpu(installed, monkeypatch, tmp_path, capsys):
    if installed:  # torchao's import is slow and not needed to be refused: a stand-in
        fake = types.ModuleType("torchao")
        fake.__spec__ = importlib.machinery.ModuleSpec("torchao", None)
        monkeypatch.setitem(sys.modules, "torchao", fake)
    else:
        monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao fails
    err = _refusal(["--workload", "tiny-adamw", "--torchao-offload"], tmp_path, capsys)
    assert "--torchao-offload: torchao's CPUOffloadOptimizer needs a CUDA GPU" in err
    assert ("pip install torchao==0.18.0" in err) != installed


def test_torchao_refused_on_a_workload_with_muon(tmp_path, capsys):
    err = _refusal(["--workload", "tiny", "--torchao-offload"], tmp_path, capsys)
    assert "--torchao-offload times AdamW-only workloads" in err and "tiny-adamw" in err


@NEEDS_NO_GPU
def test_torchao_refusal_is_not_a_traceback(tmp_path):
    cmd = [sys.executable, "-m", "muon_offload.tools.cli", "bench", "--torchao-offload"]
    cmd += ["--workload", "tiny-adamw", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and not proc.stdout
    assert "muon-offload bench: error: --torchao-offload" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_state_dict_cost_reads_every_tensor_state_dict_returns():
    """``state_dict()`` also returns each parameter's step count (0-d): the read-through buffer
    holds it beside the state, even where the host slabs hold exactly the state's bytes (the
    qwen3 bench's offloaded fp32 mode overran the buffer by its step counts)."""
    from muon_offload.tools.bench.modes import state_dict_cost

    class Saved:
        def state_dict(self):
            return {"state": {0: {"step": torch.tensor(3.0), "m": torch.ones(5, 3)}}}

        def host_buffers(self):
            return [torch.zeros(60, dtype=torch.uint8)]  # the 15 fp32 of m, no padding

    cost = state_dict_cost(Saved(), Clock(torch.device("cpu")))
    assert cost["state_bytes"] == 60
    assert cost["read_through_state_dict_s"] >= 0 and cost["read_slabs_s"] >= 0
