"""One line per stage of a bench on stderr, with the seconds since the start (tqdm's bar when
it is installed and the number of stages is known)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int | None = None, enabled: bool = True):
        self.start = time.perf_counter()
        self.enabled = enabled  # several ranks: only one prints
        self.bar = None
        if enabled and total is not None:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit="stage", file=sys.stderr, leave=False)

    def __call__(self, stage: str) -> None:
        if self.bar is not None:
            self.bar.set_description(stage)
            self.bar.update(1)
        elif self.enabled:
            print(
                f"[{time.perf_counter() - self.start:7.1f} s] {stage}", file=sys.stderr, flush=True
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
