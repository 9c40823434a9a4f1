"""The scheduler: waiting and running requests, slots, admission, abort, and the step's postprocess.

`schedule()` admits waiting requests into free slots (step-level continuous batching: a request
joins at the next step, a finished or aborted one leaves at once) and returns the newly admitted.
`postprocess()` reads the step's one host summary (`engine.summary`), has `engine.advance` advance
each row and report the tokens that became final, and lets finished rows go.

Thread safety: `add` and `abort` may be called from any thread (the server's event loop); they
take a lock and never touch a running row. Aborts of running rows take effect at the next
`schedule()`, on the thread that steps.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Sequence

import torch

from engine.advance import advance
from engine.batch import Batch
from engine.mode import DecodingMode
from engine.request import Request, StepOutput
from engine.summary import RowSummary


class Scheduler:
    def __init__(self, max_batch: int, device: torch.device) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.device = device
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_batch))  # a heap: rows take the lowest free slot
        self._aborts: set[str] = set()
        self._known: set[str] = set()  # ids of requests waiting or running
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ any thread

    def add(self, request: Request) -> None:
        with self._lock:
            if request.request_id in self._known:
                raise ValueError(f"request id {request.request_id!r} is already in the engine")
            self._known.add(request.request_id)
            self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a request: at once if it is waiting, at the next step if it is running."""
        with self._lock:
            if request_id not in self._known:
                return False
            for request in self.waiting:
                if request.request_id == request_id:
                    self.waiting.remove(request)
                    self._known.discard(request_id)
                    return True
            self._aborts.add(request_id)
            return True

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the stepping thread

    def schedule(self) -> list[Request]:
        """Apply pending aborts, admit waiting requests into free slots. Returns the newly admitted
        requests; `self.running` is the step's rows."""
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            aborted = [r for r in self.running if r.request_id in aborts]
            if aborted:
                self.running = [r for r in self.running if r.request_id not in aborts]
                for request in aborted:
                    self._release(request)
            admitted = []
            while self.waiting and self._free_slots:
                request = self.waiting.popleft()
                request.start(heapq.heappop(self._free_slots), self.device)
                self.running.append(request)
                admitted.append(request)
            if admitted:  # in slot order, so a cached forward over the slots needs no reordering
                self.running.sort(key=lambda r: r.slot)
        return admitted

    def _release(self, request: Request) -> None:
        heapq.heappush(self._free_slots, request.slot)
        self._known.discard(request.request_id)

    def postprocess(self, batch: Batch, summary: Sequence[RowSummary], mode: DecodingMode) -> list[StepOutput]:
        """Advance every row by the step's host summary (`engine.advance`); finished rows leave the batch."""
        outputs = [advance(request, info, plan, mode)
                   for request, info, plan in zip(batch.requests, summary, batch.plans, strict=True)]
        finished = [r for r, out in zip(batch.requests, outputs, strict=True) if out.finished]
        if finished:
            with self._lock:
                done = {r.request_id for r in finished}
                self.running = [r for r in self.running if r.request_id not in done]
                for request in finished:
                    self._release(request)
        return outputs
