"""What every command's options share: help that shows each default, and a device check."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the checks that use it: --help answers without torch
    import torch


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to each option's help, except where the default is None: there
    the default depends on the device or the workload, and the help text says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        if action.nargs == 0 and action.default is False:  # a flag
            return f"{action.help} (default: off)"
        return super()._get_help_string(action)


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter
    )


def torch_device(text: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, as an argparse type (a bad name is a usage error)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: runs on cpu or cuda (cuda:N)")
    return device


def check_device(ap: argparse.ArgumentParser, device: torch.device) -> None:
    """A CUDA device that this machine has, or a usage error."""
    if device.type != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        ap.error(f"--device {device}, but no CUDA GPU is available")
    if device.index is not None and device.index >= torch.cuda.device_count():
        ap.error(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
