"""Likelihood-scoring requests waiting for, or taking, their turn on the engine thread.

A scoring job (`engine.scoring.ScoringJob`) is a sequence of bounded forwards. The engine loop
runs one forward of the oldest job per turn, between two decode steps, so a scoring request near
`--max-score-tokens` never holds decoding for more than one chunk; each chunk counts as progress
for the stall detector (`/health`), and its tokens and time are metrics
(`caidllm:scoring_tokens_total`, `caidllm:scoring_chunk_seconds`). A job whose client went away
is dropped before its next chunk.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from engine.scoring import ScoringJob
from server.errors import ShuttingDown
from server.metrics import Metrics


@dataclass
class _Entry:
    job: ScoringJob
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


def _settle(future: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ScoringQueue:
    """First in, first out; `add` from the event loop, `advance` and `fail_all` from any thread."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._entries: deque[_Entry] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, job: ScoringJob) -> asyncio.Future:
        """The future gets the job's per-token logprobs once its last chunk has run."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._entries.append(_Entry(job, loop, future))
        self._gauge()
        return future

    def advance(self) -> bool:
        """Run one chunk of the oldest job (on the engine thread); whether there was one to run."""
        with self._lock:
            while self._entries and self._entries[0].future.cancelled():  # its client went away
                self._entries.popleft()
            if not self._entries:
                self._gauge()
                return False
            entry = self._entries[0]
        m = self.metrics
        result: Any = None
        error: Optional[BaseException] = None
        started = time.perf_counter()
        try:
            fed = entry.job.advance()
            if entry.job.done:
                result = entry.job.logprobs()
        except Exception as err:  # handed to the request that asked, as its own failure
            fed, error = 0, err
        m.labels(m.scoring_chunk_seconds).observe(time.perf_counter() - started)
        m.labels(m.scoring_tokens).inc(fed)
        if error is not None or entry.job.done:
            with self._lock:
                if self._entries and self._entries[0] is entry:  # not already taken by fail_all
                    self._entries.popleft()
            entry.loop.call_soon_threadsafe(_settle, entry.future, result, error)
            self._gauge()
        return True

    def fail_all(self, message: str) -> None:
        """End every job not finished with ShuttingDown(message) (the shutdown timeout ran out)."""
        with self._lock:
            entries, self._entries = list(self._entries), deque()
        for entry in entries:
            entry.loop.call_soon_threadsafe(_settle, entry.future, None, ShuttingDown(message))
        self._gauge()

    def _gauge(self) -> None:
        self.metrics.labels(self.metrics.scoring_requests).set(len(self._entries))
