"""Kept for old references: ``python bench/step.py ARGS`` is ``muon-offload bench ARGS``."""

import sys

from muon_offload.tools.bench.command import main

sys.exit(main())
