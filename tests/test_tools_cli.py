"""The ``muon-offload`` commands' options and messages: every option's help shows its default,
bad demo options are usage errors, the CPU-path notice stays above the demo's table, the demo
closes with each mode's median step time and whether the loss curves agree, and the bench
warns before a GPU-sized workload starts on the CPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from muon_offload.tools import cli, demo, tune
from muon_offload.tools.bench import command

ROOT = Path(__file__).resolve().parents[1]


def _option_blocks(help_text: str) -> dict[str, str]:
    """Each option's lines of ``--help``, keyed by the option's first line."""
    lines = help_text.split("options:", 1)[1].splitlines()
    blocks: dict[str, str] = {}
    key = None
    for line in lines:
        if re.match(r"^  -", line):
            key = line.strip()
            blocks[key] = line
        elif key is not None and line.startswith("    "):
            blocks[key] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("name", ["demo", "bench", "tune"])
def test_every_option_has_help_with_its_default(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: muon-offload {name}") and "``" not in out
    blocks = _option_blocks(out)
    assert len(blocks) >= 4, out
    for key, text in blocks.items():
        if key.startswith("-h, --help"):
            continue
        assert "default" in text.lower(), f"{name}: {text}"


def test_top_level_help(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {c} " in out for c in ("demo", "bench", "tune")) and "``" not in out


@pytest.mark.parametrize(
    "args",
    [["--help"], ["nonsense"], ["demo", "--help"], ["bench", "--help"], ["tune", "--help"]],
)
def test_the_command_answers_before_importing_torch(args):
    # As the installed ``muon-offload`` script runs it: the module imported, then main(); a
    # command's --help exits through argparse (SystemExit 0).
    code = (
        "import sys\n"
        "from muon_offload.tools.cli import main\n"
        "try:\n"
        f"    code = main({args!r})\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "heavy = ('torch', 'triton', 'numpy')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "print(code, heavy[:5])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == f"{2 if args == ['nonsense'] else 0} []", proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "foo"], "not a device: 'foo'"),
        (["--device", "meta"], "runs on cpu or cuda"),
        (["--chunk-bytes", "0"], "--chunk-bytes must be >= 1"),
        (["--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_demo_argument_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: muon-offload demo") and message in err


def test_demo_prints_the_cpu_notice_once_above_its_table():
    env = dict(
        os.environ,
        PYTHONPATH=os.environ.get("PYTHONPATH", ""),
        CUDA_VISIBLE_DEVICES="",  # the CPU path, also on a machine with GPUs
    )
    cmd = [sys.executable, "-m", "muon_offload.tools.cli", "demo", "--steps", "2"]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("offload=True without CUDA") == 1, proc.stderr
    # stdout and stderr interleave on a terminal: the notice is logged before the table starts.
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["step"])
    assert [line.split()[0] for line in lines[header + 1 : header + 3]] == ["1", "2"]
    assert lines[header + 3].startswith("offloaded optimizer state")
    assert "offload=True" not in proc.stdout
    # Closing: each mode's median step time, then the curves' agreement: bitwise on the CPU,
    # whose path is deterministic and whose offloaded step gives the resident step's bits.
    times = lines[header + 4 : header + 7]
    assert "median of steps 2-2" in times[0]
    assert [line.split()[0] for line in times[1:]] == ["resident", "offloaded"]
    assert lines[header + 7 :] == ["loss curves: bitwise equal at all 2 steps"]


def test_demo_loss_curves_agree_bitwise_within_the_tolerance_or_not():
    assert demo.agreement([3.0, 2.0], [3.0, 2.0]) == (
        True,
        "loss curves: bitwise equal at all 2 steps",
    )
    near = 2.0 * (1 + demo.LOSS_RTOL / 2)
    agree, sentence = demo.agreement([3.0, 2.0], [3.0, near])
    assert agree and "within relative 0.001" in sentence and "at step 2" in sentence
    far = 2.0 * (1 + demo.LOSS_RTOL * 2)
    agree, sentence = demo.agreement([3.0, 2.0], [3.0, far])
    assert not agree and "DIFFER" in sentence and "at step 2" in sentence
    nan = float("nan")
    assert not demo.agreement([3.0, nan], [3.0, nan])[0]
    assert not demo.agreement([3.0, 2.0], [3.0, nan])[0]


def test_demo_step_time_is_the_median_of_the_steps_after_the_first():
    header, resident, offloaded = demo.step_times(
        ["resident", "offloaded"], [[0.5, 0.004, 0.001, 0.002], [0.1, 0.003, 0.3, 0.002]]
    )
    assert "median of steps 2-4" in header
    assert resident.split() == ["resident", "2.00", "ms", "500.00", "ms"]
    assert offloaded.split() == ["offloaded", "3.00", "ms", "100.00", "ms"]


class _Stop(Exception):
    pass


def _bench_until_run(monkeypatch, capsys, tmp_path, *args) -> str:
    """What ``muon-offload bench`` printed to stderr before it started measuring."""
    seen = {}

    def run(parsed):
        seen["err"] = capsys.readouterr().err
        raise _Stop

    monkeypatch.setattr(command, "run", run)
    with pytest.raises(_Stop):
        command.main([*args, "--device", "cpu", "--no-dion", "--out", str(tmp_path)])
    return seen["err"]


def test_bench_warns_before_a_gpu_sized_workload_on_the_cpu(monkeypatch, capsys, tmp_path):
    err = _bench_until_run(
        monkeypatch, capsys, tmp_path, "--workload", "llama3-8b-fsdp8-rank", "--layers", "1"
    )
    assert "warning: llama3-8b-fsdp8-rank (1 layers" in err and "sized for a GPU" in err
    assert "--workload tiny" in err


def test_bench_on_tiny_does_not_warn(monkeypatch, capsys, tmp_path):
    assert "warning" not in _bench_until_run(monkeypatch, capsys, tmp_path, "--workload", "tiny")


def test_tune_state_dtype_offers_int8(capsys):
    assert tune._parse(["--state-dtype", "int8"]).state_dtype == "int8"
    with pytest.raises(SystemExit) as exit_info:
        tune._parse(["--state-dtype", "int4"])
    assert exit_info.value.code == 2
    assert "choose from 'bf16', 'fp32', 'int8'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_tune_refuses_without_a_gpu(capsys):
    assert cli.main(["tune", "--state-dtype", "int8"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    "state_dtype, kernels",
    [
        ("fp32", {"adamw", "muon_prep", "muon_apply"}),
        # tiny's 48x96 matrices and 100x48 embedding hold 8-bit state; its 33x70 matrices and
        # norms are under 4,096 elements and keep fp32 state.
        ("int8", {"adamw", "adamw8", "muon_prep", "muon_prep8", "muon_apply"}),
    ],
)
def test_tune_launches_the_kernels_of_the_state_dtype(state_dtype, kernels):
    """The kernels ``tune`` times: on a GPU, timing each config; on the CPU, run once under the
    interpreter (nothing timed)."""
    args = tune._parse(["--workload", "tiny", "--layers", "1", "--state-dtype", state_dtype])
    rows = tune.tune_kernels(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    assert {r["kernel"] for r in rows} == kernels
    prep = {r["shape"]: r["kernel"] for r in rows if r["kernel"].startswith("muon_prep")}
    if state_dtype == "int8":
        assert prep == {
            "2 x 48x96": "muon_prep8",
            "1 x 96x48": "muon_prep8",
            "1 x 33x70": "muon_prep",
        }
