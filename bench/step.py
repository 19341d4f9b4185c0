"""Kept for old references: ``python bench/step.py ARGS`` is ``muon-offload bench ARGS``."""

import sys

from muon_offload.bench import main

sys.exit(main())
