"""The ``muon-offload`` command: ``demo`` (default), ``bench``, ``tune``."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": "muon_offload.tools.demo",
    "bench": "muon_offload.tools.bench.command",
    "tune": "muon_offload.tools.tune",
}
USAGE = """usage: muon-offload [demo|bench|tune] [options]

  demo   train a small GPT with offloaded and resident Muon side by side (default)
  bench  time the optimizer step on a named workload, every mode side by side
  tune   tune the Triton kernels for a workload's shapes on this GPU

muon-offload COMMAND --help lists a command's options and their defaults."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "demo"
    if command not in COMMANDS:
        print(
            f"muon-offload: unknown command {command!r}; expected one of {sorted(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    return importlib.import_module(COMMANDS[command]).main(argv)


if __name__ == "__main__":
    sys.exit(main())
