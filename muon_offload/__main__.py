"""``python -m muon_offload``: a short diagnostic of this install (tools/diagnose.py)."""

from .tools.diagnose import main

raise SystemExit(main())
