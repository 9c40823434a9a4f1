"""The progress bar of the long commands (eval, score, calibrate): on stderr, moved after every
engine step (a row counts by the share of its canvas committed, `Engine.generate`'s `on_progress`),
so it moves from the first seconds and its ETA comes from the work done so far."""

from __future__ import annotations

import sys
from typing import Any

_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {n:.DECIMALSf}/{total_fmt} {unit} [{elapsed}<{remaining}, {rate_fmt}]"


class Progress:
    """A bar over `total` items whose position may be a fraction (shown with `decimals`); `at(done)`
    moves it there."""

    def __init__(self, total: float, unit: str, desc: str = "", decimals: int = 1) -> None:
        from tqdm import tqdm

        self.bar: Any = tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True,
                             bar_format=_FORMAT.replace("DECIMALS", str(decimals)))

    def at(self, done: float) -> None:
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)

    def restart(self, total: float, desc: str) -> None:
        """A new stage of `total` items: the bar, its rate and its ETA start again."""
        self.bar.reset(total=total)
        self.bar.set_description(desc)

    def write(self, line: str) -> None:
        self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
