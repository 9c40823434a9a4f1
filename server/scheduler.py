"""The scheduler: an asyncio front end feeding an engine loop that runs in its own thread.

The event loop never computes: handlers `submit` requests into a bounded waiting queue and await
events on their own asyncio queue. The engine thread owns the runner: each iteration it applies
aborts, admits waiting requests into free rows (step-level continuous batching: a request joins at
the next step, a finished or aborted one leaves at once), runs one step, and posts progress (the
final prefix, for streams) and results back with `call_soon_threadsafe`.

After a step that frees rows nobody is waiting for, the loop may hold the next step a few
milliseconds for the requests about to fill them (server/admission.py: bounded by the freed rows'
share of a step and by `admission_wait`, and only while recent refills came that soon).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.decoding import GenerationRequest, GenerationResult, RequestError
from engine.engine import Engine
from server.admission import RefillTracker, admission_limit
from server.energy import EnergyMeter, share_energy
from server.metrics import Metrics

_IDLE_WAIT = 0.05


class QueueFull(Exception):
    pass


@dataclass
class Event:
    kind: str  # "progress" (stable ids so far), "done" (result), "error" (message)
    choice: int
    ids: Optional[list[int]] = None
    result: Optional[GenerationResult] = None
    message: str = ""
    joules: Optional[float] = None


@dataclass
class Submission:
    request: GenerationRequest
    choice: int
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    stream: bool
    submitted: float = field(default_factory=time.perf_counter)
    admitted: Optional[float] = None
    first_token: Optional[float] = None
    joules: float = 0.0
    sent: int = 0

    def post(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class EngineLoop:
    def __init__(self, engine: Engine, max_queue: int, metrics: Metrics, meter: EnergyMeter,
                 admission_wait: float = 0.0) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.admission_wait = admission_wait
        self.metrics = metrics
        self.meter = meter
        self.runner = engine.new_runner()
        self._waiting: deque[Submission] = deque()
        self._active: dict[str, Submission] = {}
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last_progress = time.monotonic()
        self.steps = 0
        self.step_seconds = 0.0  # moving average of a step's duration, for the admission wait
        self._refills = RefillTracker(horizon=2 * admission_wait)
        self._thread = threading.Thread(target=self._run, name="cai-dllm-engine", daemon=True)

    # ------------------------------------------------------------------ called from the event loop

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_pending(self) -> int:
        """Requests waiting or decoding."""
        with self._lock:
            return len(self._waiting) + len(self._active)

    def submit(self, submission: Submission) -> None:
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull
            self._waiting.append(submission)
        if self.admission_wait > 0:
            self._refills.request_arrived(time.monotonic())
        self.metrics.labels(self.metrics.waiting).set(len(self._waiting))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        freed = 0
        while not self._stop.is_set():
            self._await_arrivals(freed)
            self._apply_aborts()
            self._admit()
            if self.runner.num_active == 0:
                self.last_progress = time.monotonic()
                self._wake.wait(_IDLE_WAIT)
                self._wake.clear()
                continue
            try:
                freed = self._step()
            except Exception as err:  # a bug of ours: fail the rows in flight, keep serving
                for sub in list(self._active.values()):
                    self.runner.abort(sub.request.request_id)
                    sub.post(Event("error", sub.choice, message=f"internal error in the engine: {err!r}"))
                self._active.clear()
                self.runner = self.engine.new_runner()

    def _await_arrivals(self, freed: int) -> None:
        if freed == 0 or self.admission_wait <= 0 or self.runner.num_active == 0:
            return
        active = self.runner.num_active
        wanted = min(freed, self.runner.max_batch - active)
        unfilled = wanted - len(self._waiting)
        if unfilled <= 0:
            return
        now = time.monotonic()
        self._refills.rows_freed(unfilled, now)
        limit = admission_limit(self.admission_wait, self.step_seconds, active, wanted)
        if self._refills.expected_refill(now) > limit:
            return
        deadline = now + limit
        while not self._stop.is_set() and len(self._waiting) < wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wake.wait(remaining)
            self._wake.clear()

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            kept = deque(s for s in self._waiting if s.request.request_id not in aborts)
            self._waiting = kept
        for request_id in aborts:
            if request_id in self._active:
                self.runner.abort(request_id)
                del self._active[request_id]
        self._update_gauges()

    def _admit(self) -> None:
        while self.runner.has_capacity:
            with self._lock:
                if not self._waiting:
                    break
                sub = self._waiting.popleft()
            try:
                self.runner.add(sub.request, queued_at=sub.submitted)
            except RequestError as err:
                sub.post(Event("error", sub.choice, message=str(err)))
                continue
            sub.admitted = time.perf_counter()
            self.metrics.labels(self.metrics.queue_time).observe(sub.admitted - sub.submitted)
            self._active[sub.request.request_id] = sub
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.labels(self.metrics.waiting).set(len(self._waiting))
        self.metrics.labels(self.metrics.running).set(len(self._active))

    def _step(self) -> int:
        """One step of every active row; returns how many rows it finished."""
        m = self.metrics
        before = self.meter.read_joules()
        batch = self.runner.num_active
        started = time.monotonic()
        finished = self.runner.step()
        took = time.monotonic() - started
        after = self.meter.read_joules()
        self.step_seconds = took if self.steps == 0 else 0.8 * self.step_seconds + 0.2 * took
        self.steps += 1
        self.last_progress = time.monotonic()
        m.labels(m.batch_size).observe(batch)
        if before is not None and after is not None:
            step_joules = max(0.0, after - before)
            m.labels(m.joules).inc(step_joules)
            for request_id, joules in share_energy(step_joules, self.runner.last_step_work).items():
                if request_id in self._active:
                    self._active[request_id].joules += joules
        done = {r.request_id: r for r in finished}
        now = time.perf_counter()
        for request_id, sub in list(self._active.items()):
            result = done.get(request_id)
            if result is not None:
                m.labels(m.tokens_per_step).observe(result.stats.tokens_per_step[-1])
                self._finish(sub, result, now)
                continue
            m.labels(m.tokens_per_step).observe(self.runner.rows_last_commits.get(request_id, 0))
            if sub.first_token is not None and not sub.stream:
                continue  # nothing left to learn from its committed prefix before it finishes
            ids = self.runner.stable_ids(request_id)
            if ids and sub.first_token is None:
                sub.first_token = now
                m.labels(m.ttft).observe(now - sub.submitted)
            if sub.stream and len(ids) > sub.sent:
                sub.sent = len(ids)
                sub.post(Event("progress", sub.choice, ids=ids))
        self._update_gauges()
        return len(done)

    def _finish(self, sub: Submission, result: GenerationResult, now: float) -> None:
        m = self.metrics
        del self._active[sub.request.request_id]
        if sub.first_token is None:
            sub.first_token = now
            m.labels(m.ttft).observe(now - sub.submitted)
        stats = result.stats
        m.labels(m.e2e).observe(now - sub.submitted)
        m.labels(m.nfe).observe(stats.nfe)
        m.labels(m.steps_saved_request).observe(stats.steps_saved)
        m.labels(m.steps_saved).inc(max(0, stats.steps_saved))
        m.labels(m.steps).inc(stats.steps)
        m.labels(m.forced).inc(stats.forced_commits)
        m.labels(m.grinding).inc(stats.grinding_exits)
        joules = None
        if self.meter.name != "none":
            joules = sub.joules
            m.labels(m.request_joules).observe(joules)
        sub.post(Event("done", sub.choice, result=result, joules=joules))


def summary_of(result: GenerationResult) -> dict[str, Any]:
    stats = result.stats
    return {"nfe": stats.nfe, "steps": stats.steps, "steps_saved": stats.steps_saved,
            "fixed_step_budget": stats.fixed_step_budget, "forced_commits": stats.forced_commits,
            "grinding_exits": stats.grinding_exits}
