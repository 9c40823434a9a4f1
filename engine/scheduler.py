"""The scheduler: waiting and running requests, slots, admission, abort, and the step's postprocess.

`schedule()` admits waiting requests into free slots (step-level continuous batching: a request
joins at the next step, a finished or aborted one leaves at once) and returns the newly admitted.
`postprocess()` reads the step's one host summary (`engine.summary`), has `engine.advance` advance
each row and report the tokens that became final, and lets finished rows go.

Slots stay compact: the running rows hold slots [0, n), row b in slot b, so that a forward over the
running rows reads the store's first n rows as a view. When rows leave, the rows in the highest
slots move into the holes (`move_slot(src, dst)`, `Slots.move`: one copy of each moved row's state
at its release, never one a step).

Thread safety: `add` and `abort` may be called from any thread (the server's event loop); they
take a lock and never touch a running row. Aborts of running rows take effect at the next
`schedule()`, on the thread that steps.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from engine.advance import advance
from engine.batch import Batch
from engine.mode import DecodingMode
from engine.request import Request, StepOutput
from engine.summary import RowSummary


class Scheduler:
    def __init__(self, max_batch: int, device: torch.device, move_slot: Callable[[int, int], None]) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.device = device
        self.move_slot = move_slot
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # row b holds slot b
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
                self._release(aborted)
            admitted = []
            while self.waiting and len(self.running) < self.max_batch:
                request = self.waiting.popleft()
                request.start(len(self.running), self.device)
                self.running.append(request)
                admitted.append(request)
        return admitted

    def _release(self, leaving: list[Request]) -> None:
        """Drop these running rows and keep the slots compact: each row in a slot past the rows that
        stay moves into a hole a leaving row made, the rows again in slot order."""
        gone = {r.request_id for r in leaving}
        self._known -= gone
        staying = [r for r in self.running if r.request_id not in gone]
        holes = sorted(r.slot for r in leaving if r.slot < len(staying))
        movers = [r for r in staying if r.slot >= len(staying)]  # in slot order
        for request, hole in zip(movers, holes, strict=True):
            self.move_slot(request.slot, hole)
            request.move_to(hole)
        self.running = sorted(staying, key=lambda r: r.slot)

    def postprocess(self, batch: Batch, summary: Sequence[RowSummary], mode: DecodingMode,
                    before_release: Optional[Callable[[], None]] = None) -> list[StepOutput]:
        """Advance every row by the step's host summary (`engine.advance`); finished rows leave the batch.
        `before_release` runs after the advance and before a finished row's slot takes another row
        (what reads a finished row's cache: the prefix cache's insert)."""
        outputs = [advance(request, info, plan, mode)
                   for request, info, plan in zip(batch.requests, summary, batch.plans, strict=True)]
        if before_release is not None:
            before_release()
        finished = [r for r, out in zip(batch.requests, outputs, strict=True) if out.finished]
        if finished:
            with self._lock:
                self._release(finished)
        return outputs
