"""What a bench ran on, recorded beside every figure: the card, the driver, the versions and
the time."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess

import torch


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def driver_version() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 else None


def card(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict:
    return {
        "torch": torch.__version__,
        "triton": triton_version(),
        "python": platform.python_version(),
    }


def record(device: torch.device, args=None) -> dict:
    """What a figure ran on, as a bench's JSON ``info`` holds it: card, driver, versions, the
    time, and the command's arguments when given."""
    info = {"card": card(device), "driver": driver_version(), **versions(), "date": now()}
    if args is not None:
        info["args"] = vars(args)
    return info
