"""The scheduler: waiting and running requests, slots, admission, abort, and the step's postprocess.

`schedule()` admits waiting requests into free slots (step-level continuous batching: a request
joins at the next step, a finished or aborted one leaves at once) and returns the newly admitted.
`postprocess()` reads the step's one host summary (`engine.summary`), advances each row
(`engine.advance`: telemetry, block moves, finishing) and reports the tokens that became final.

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
from engine.decoding.types import TokenLogprob
from engine.request import FORWARD_STORE, Request, StepOutput
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

    def postprocess(self, rows: Sequence[Request], summary: Sequence[RowSummary],
                    fed: Sequence[int]) -> list[StepOutput]:
        """Advance every row by the step's host summary; finished rows leave the batch."""
        outputs: list[StepOutput] = []
        finished: list[Request] = []
        for request, info, fed_tokens in zip(rows, summary, fed, strict=True):
            storing = request.forward_kind() == FORWARD_STORE
            # generated tokens that can no longer change: no mask before them (a store pass commits nothing)
            stable = request.block_start - request.origin + (0 if storing else min(info.first_masked,
                                                                                   request.block_length))
            if request.logprobs is not None and not storing:
                self._record_logprobs(request, info)
            result = advance(request, info, storing)
            if request.edits:  # block-edit may still change its block: finished blocks only
                stable = request.block_start - request.origin
            if result is not None:
                stable = request.tail + len(result.generated_ids)
            new_ids, new_logprobs = request.take_new_final(min(stable, request.tail + request.gen_length))
            outputs.append(StepOutput(request.request_id, new_ids, info.committed, fed_tokens, result,
                                      new_logprobs))
            if result is not None:
                finished.append(request)
        if finished:
            with self._lock:
                done = {r.request_id for r in finished}
                self.running = [r for r in self.running if r.request_id not in done]
                for request in finished:
                    self._release(request)
        return outputs

    @staticmethod
    def _record_logprobs(request: Request, info: RowSummary) -> None:
        """The logprobs of the positions this step wrote a token to (masked before it, or block-edit's
        edits): a position's logprobs are those of the step that wrote its final token."""
        offset = request.block_start - request.origin
        k = request.params.logprobs or 0
        for position in range(request.block_length):
            token = info.tokens[position]
            if request.generated[offset + position] != token and token != request.mask_id:
                chosen, top = info.logprob(position)
                request.logprobs[offset + position] = TokenLogprob(token, chosen, top[:k])  # type: ignore[index]
