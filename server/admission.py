"""When to hold the next engine step for requests about to arrive (the admission wait).

A client that sends its next request as soon as it has a response always misses the step that
starts the moment its row frees, so its row runs empty for a whole step per request; with CAI's
few steps a request that is a large share of the batch (8 closed-loop clients kept 6.7 of 8 rows
busy on the built-in model). Holding the next step until the rows refill pays only when the
refill comes soon: waiting `w` idles every active row for `w`, while not waiting idles the freed
rows for one step. So the loop waits at most

    step time x freed rows / (active + freed rows)     (and never more than the configured cap)

and only when the refills seen lately came within that: `RefillTracker` times, passively, how long
freed rows stayed unfilled until a request arrived, whether or not the loop waited for it. Under
open-loop load few arrivals follow frees closely, the tracker's median goes past the bound and the
loop stops waiting, so the wait costs nothing where it cannot help.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque

# Refill times remembered: enough for a stable median, few enough to follow a change of load.
_WINDOW = 32


def admission_limit(cap: float, step_seconds: float, active: int, freed: int) -> float:
    """The longest wait that can pay for itself: the freed rows' share of one step, at most `cap`."""
    if cap <= 0 or active <= 0 or freed <= 0:
        return 0.0
    return min(cap, step_seconds * freed / (active + freed))


class RefillTracker:
    """Seconds from a row freeing (with nobody waiting for it) to the arrival of a request.

    Freed rows are matched to arrivals first in, first out. A row still unfilled after `horizon`
    seconds counts as never refilled (infinity): an arrival that late is no reason to wait.
    With no history yet the tracker expects refills at once, so a new closed-loop load is
    waited for from its first request; the misses of an open-loop load end that within a few steps.
    """

    def __init__(self, horizon: float, window: int = _WINDOW) -> None:
        self.horizon = horizon
        self._freed: deque[float] = deque()
        self._latencies: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def rows_freed(self, count: int, now: float) -> None:
        with self._lock:
            self._expire(now)
            self._freed.extend([now] * count)

    def request_arrived(self, now: float) -> None:
        with self._lock:
            self._expire(now)
            if self._freed:
                self._latencies.append(now - self._freed.popleft())

    def expected_refill(self, now: float) -> float:
        """The median refill time of the recent freed rows (0 with no history)."""
        with self._lock:
            self._expire(now)
            return statistics.median(self._latencies) if self._latencies else 0.0

    def _expire(self, now: float) -> None:
        while self._freed and now - self._freed[0] > self.horizon:
            self._freed.popleft()
            self._latencies.append(math.inf)
