"""The ``muon-offload`` command: ``demo`` (default), ``bench``, ``tune``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "demo": "muon_offload.demo",
        "bench": "muon_offload.bench",
        "tune": "muon_offload.tune",
    }
    if argv and argv[0] in ("-h", "--help"):
        print(
            "usage: muon-offload [demo|bench|tune] [options]\n\n"
            "  demo   train a small GPT with offloaded and resident Muon side by side (default)\n"
            "  bench  time the optimizer step on a named workload, every mode side by side\n"
            "  tune   tune the Triton kernels for a workload's shapes on this GPU"
        )
        return 0
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "demo"
    if command not in commands:
        print(
            f"muon-offload: unknown command {command!r}; expected one of {sorted(commands)}",
            file=sys.stderr,
        )
        return 2
    module = __import__(commands[command], fromlist=["main"])
    return module.main(argv)


if __name__ == "__main__":
    sys.exit(main())
