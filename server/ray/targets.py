"""The scrape targets of a scaled-out deployment, as Prometheus's HTTP service discovery reads them.

Behind Ray Serve's proxy, `/metrics` reaches one replica at a time, so each replica serves its own
registry on its own port and registers that address here. An entry lives while its replica keeps
refreshing it: a replica that dies without a word (SIGKILL, a lost node) drops out after `ttl_s`,
and Prometheus stops scraping it. Time is the book's own monotonic clock, so replicas on other
machines never compare clocks.

Pure bookkeeping, no Ray: `server/ray/metrics.py` holds a book in a named actor."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# A replica refreshes every REFRESH_S; several missed refreshes in a row mean it is gone.
REFRESH_S = 5.0
DEFAULT_TTL_S = 6 * REFRESH_S


@dataclass(frozen=True)
class ScrapeTarget:
    address: str  # host:port of the replica's own metrics endpoint
    labels: dict[str, str]


class TargetBook:
    """Replica id → its scrape target and when it last refreshed it."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, tuple[ScrapeTarget, float]] = {}

    def register(self, replica: str, target: ScrapeTarget) -> None:
        """Adds or refreshes `replica`'s entry (a replacement replica has a new id and a new entry)."""
        self._entries[replica] = (target, self._clock())

    def remove(self, replica: str) -> None:
        self._entries.pop(replica, None)

    def live(self) -> dict[str, ScrapeTarget]:
        now = self._clock()
        self._entries = {r: (t, seen) for r, (t, seen) in self._entries.items() if now - seen <= self._ttl_s}
        return {r: t for r, (t, _) in self._entries.items()}

    def http_sd(self) -> list[dict[str, object]]:
        """Prometheus `http_sd_configs` format: one target group per replica, its labels attached."""
        return [{"targets": [t.address], "labels": {"replica": r, **t.labels}}
                for r, t in sorted(self.live().items())]
