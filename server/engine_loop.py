"""The engine loop: the bridge between asyncio handlers and the engine, which steps in a thread of
its own, and the server's one door to the engine (what the server reads of the model comes through
its properties).

Handlers `resolve` a request once (`Engine.resolve`: what it costs is read from that) and `submit`
it; the engine queues it at once (`Engine.submit` is thread-safe), so a bad request fails in its
handler and the waiting queue is the engine's own.
The engine thread only loops over `Engine.step()` and routes each step's outputs to the
submissions they belong to: one callback per event loop per step (`call_soon_threadsafe`) carries
every event of that step. A streamed request gets every non-empty delta; a whole one collects its
deltas here and gets them with its result, so it wakes once. Likelihood-scoring requests run on
the same thread, one bounded chunk between two steps (server/scoring_jobs.py).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from engine import Engine, GenerationResult, StepOutput
from engine.decoding.types import RequestStats, TokenLogprob
from engine.errors import RequestError
from engine.request import Resolved
from server.energy import EnergyMeter, share_energy
from server.errors import QueueFull
from server.metrics import Metrics
from server.protocol import DecodingSummary
from server.scoring_jobs import ScoringQueue

_IDLE_WAIT = 0.05
_RATE_WINDOW = 64  # completions the Retry-After rate is measured over
_RATE_HORIZON = 60.0  # seconds: older completions say nothing about the rate now
RETRY_AFTER_MAX = 300  # seconds: beyond it a client had better give up than wait on our estimate


@dataclass
class Event:
    kind: str  # "delta" (token ids that became final), "done" (result, with the last ids), "error" (message)
    choice: int
    ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # of `ids`, when the request asked for them
    result: Optional[GenerationResult] = None
    message: str = ""
    joules: Optional[float] = None
    status: int = 500  # of an "error": 500 for our failure, 503 when shutting down
    code: Optional[str] = None
    # a streamed delta's decoding summary so far: what its choice reports if the output path ends it
    # here (a stop string, max_tokens), before the engine finishes the row
    summary: Optional[DecodingSummary] = None
    cached_tokens: int = 0  # the request's prompt tokens restored from the engine's prefix cache


@dataclass
class Submission:
    """One choice of an API request, as the engine takes it and the handler waits on it."""

    request_id: str
    request: Resolved  # what the engine runs (EngineLoop.resolve)
    choice: int
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    stream: bool  # known when the submission is built: streams get each delta as it comes
    submitted: float = field(default_factory=time.perf_counter)
    first_token: Optional[float] = None
    joules: float = 0.0
    held: list[int] = field(default_factory=list)  # a whole response's deltas, until it finishes
    held_logprobs: list[TokenLogprob] = field(default_factory=list)

    def post(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def _deliver(events: Sequence[tuple[asyncio.Queue, Event]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)


class EngineLoop:
    def __init__(self, engine: Engine, max_queue: int, metrics: Metrics, meter: EnergyMeter) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.meter = meter
        self._active: dict[str, Submission] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last_progress = time.monotonic()
        self.steps = 0
        self._scoring = ScoringQueue(metrics)
        self._finish_times: deque[float] = deque(maxlen=_RATE_WINDOW)  # when the last requests finished
        self._cache_counted = (0, 0)  # the prefix cache's queries and hits already added to the metrics
        self._thread = threading.Thread(target=self._run, name="cai-dllm-engine", daemon=True)
        # what the server knows of the engine: facts fixed once the model is loaded
        model = engine.model
        self.tokenizer: Optional[Any] = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.end_ids = frozenset(model.special.end_ids)
        self.mask_id = model.special.mask_id
        self.architecture = engine.architecture
        self.attention_backend = model.attention_backend
        self.quantization = model.quantization
        self.quantized_head = model.quantized_head
        self.max_logprobs = engine.config.max_logprobs
        # called once, from the engine thread, when the engine faults (a tensor-parallel worker died
        # or hung): every request in flight has failed, and the loop has stopped
        self.on_fault: Optional[Callable[[str], None]] = None

    # ------------------------------------------------------------------ the engine, from any thread

    def resolve(self, prompt_ids: Sequence[int], knobs: Mapping[str, Any], max_tokens: Optional[int]) -> Resolved:
        """The request as the engine will run it (`Engine.resolve`, any thread): priced, then submitted
        as it is; RequestError naming the knob that is wrong."""
        return self.engine.resolve(prompt_ids, knobs, max_tokens)

    def set_chat_template(self, template: str) -> None:
        """Use this Jinja chat template instead of the checkpoint's (`serve --chat-template`)."""
        if self.engine.tokenizer is None:
            raise ValueError("--chat-template needs a checkpoint with a tokenizer")
        self.engine.tokenizer.chat_template = template

    def warm_up(self) -> None:
        """One tiny decode before the loop starts, so the first request pays no first-call costs."""
        try:
            params = self.engine.resolve([0], {"gen_length": 4, "block_length": 4, "steps": 4}).params
        except RequestError:  # a mode whose block is the model's own (uniform noise: its canvas), one step
            params = self.engine.resolve([0], {"gen_length": 1, "max_denoising_steps": 1}).params
        self.engine.generate([[0]], params)
        cache = self.engine.prefix_cache
        if cache is not None:  # the warm-up is no request: it neither counts nor stays cached
            cache.clear()
            self._cache_counted = (cache.queries, cache.hits)

    async def score(self, prompt_ids: Sequence[int], samples: int, seed: int) -> list[Optional[float]]:
        """Per-token likelihood estimates of a prompt (`Engine.score`'s numbers): the job's masks are
        drawn off the event loop and off the engine thread, then it runs on the engine thread, a
        chunk between two decode steps. RequestError for a prompt or sample count the engine
        refuses; QueueFull when the waiting queue is full."""
        job = await asyncio.to_thread(self.engine.scoring_job, prompt_ids, samples, seed)
        with self._lock:  # jobs behind the one running count against the waiting queue
            if self._waiting_after(0) + len(self._scoring) > self.max_queue:
                raise QueueFull
            future = self._scoring.add(job)
        self._wake.set()
        return await future

    # ------------------------------------------------------------------ called from the event loop

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.engine.close()  # a tensor-parallel engine's workers

    @property
    def fault(self) -> Optional[str]:
        """Why the engine cannot go on (engine.Engine.fault), or None."""
        return self.engine.fault

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def num_pending(self) -> int:
        """Requests waiting or decoding."""
        with self._lock:
            return len(self._active) + len(self._scoring)

    def submit(self, submissions: Sequence[Submission]) -> None:
        """Queue the requests of one API request (its choices) in the engine, all or none. Raises
        QueueFull when more than `max_queue` requests would wait once the free rows are filled, or
        the engine's RequestError for a request it cannot take (the message names what is wrong)."""
        with self._lock:
            if self._waiting_after(len(submissions)) > self.max_queue:
                raise QueueFull
            added: list[str] = []
            try:
                for sub in submissions:
                    self.engine.submit(sub.request, sub.request_id, queued_at=sub.submitted)
                    self._active[sub.request_id] = sub
                    added.append(sub.request_id)
            except Exception:
                for request_id in added:
                    self._active.pop(request_id, None)
                    self.engine.abort(request_id)
                raise
        self._update_gauges()
        self._wake.set()

    def _waiting_after(self, adding: int) -> int:
        """Requests that would wait for a row with `adding` more, once the next step fills the free rows
        (those are not queued: counting them refused requests an idle server could take at once)."""
        free = max(0, self.engine.max_batch - self.engine.num_running)
        return max(0, self.engine.num_waiting + adding - free)

    def retry_after(self) -> int:
        """Seconds until the waiting queue has room again, for a 429's Retry-After: the requests
        ahead (waiting, plus this one) over the recent completion rate, whole seconds in
        [1, RETRY_AFTER_MAX]. With no completions yet to measure a rate from: 1."""
        now = time.perf_counter()
        times = [t for t in self._finish_times if now - t <= _RATE_HORIZON]
        if len(times) < 2 or times[-1] <= times[0]:
            return 1
        rate = (len(times) - 1) / (times[-1] - times[0])  # requests finished per second, lately
        waiting = self.engine.num_waiting + 1
        return max(1, min(RETRY_AFTER_MAX, math.ceil(waiting / rate)))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._active.pop(request_id, None)
        self.engine.abort(request_id)
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.engine.fault is not None:
                self._end_on_fault(self.engine.fault)
                return
            if self._scoring.advance():  # a chunk of scoring is progress too (/health)
                self.last_progress = time.monotonic()
            if not self.engine.has_unfinished():
                if len(self._scoring):
                    continue
                self.last_progress = time.monotonic()
                self._wake.wait(_IDLE_WAIT)
                self._wake.clear()
                continue
            try:
                self._step()
            except Exception as err:  # a bug of ours: fail the rows in flight, keep serving
                self._fail_all(f"internal error in the engine: {err!r}")

    def shut_out(self, message: str) -> None:
        """End every request in flight now (the shutdown timeout ran out): each gets a 503 error
        event and its rows are freed; scoring jobs not yet run fail the same way. Any thread."""
        with self._lock:
            subs, self._active = list(self._active.values()), {}
        for sub in subs:
            self.engine.abort(sub.request_id)
            sub.post(Event("error", sub.choice, message=message, status=503, code="shutting_down"))
        self._scoring.fail_all(message)
        self._wake.set()

    def _end_on_fault(self, reason: str) -> None:
        """The engine cannot step again: fail everything in flight (503) and stop the loop."""
        message = f"the engine failed: {reason}"
        with self._lock:
            failed, self._active = list(self._active.values()), {}
        for sub in failed:
            sub.post(Event("error", sub.choice, message=message, status=503, code="engine_dead"))
        self._scoring.fail_all(message)
        if self.on_fault is not None:
            self.on_fault(reason)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            failed, self._active = list(self._active.values()), {}
            self.engine.reset()  # the failed step may have left rows half advanced
        if self.engine.fault is not None:  # the step failed because the engine did (a worker died):
            with self._lock:  # the loop's next turn ends everything on the fault
                self._active.update((sub.request_id, sub) for sub in failed)
            return
        for sub in failed:
            sub.post(Event("error", sub.choice, message=message))

    def _update_gauges(self) -> None:
        m = self.metrics
        m.labels(m.waiting).set(self.engine.num_waiting)
        m.labels(m.running).set(self.engine.num_running)

    def _count_prefix_cache(self) -> None:
        """The prefix cache's lookups and hits since the last step (tokens, vLLM's counters) and the
        bytes it holds (engine thread)."""
        cache, m = self.engine.prefix_cache, self.metrics
        if cache is None:
            return
        queries, hits = self._cache_counted
        m.labels(m.prefix_cache_queries).inc(cache.queries - queries)
        m.labels(m.prefix_cache_hits).inc(cache.hits - hits)
        m.labels(m.prefix_cache_bytes).set(cache.bytes_held)
        self._cache_counted = (cache.queries, cache.hits)

    def _step(self) -> None:
        m = self.metrics
        before = self.meter.read_joules()
        outputs = self.engine.step()
        after = self.meter.read_joules()
        self.steps += 1
        self.last_progress = time.monotonic()
        if outputs:
            m.labels(m.batch_size).observe(len(outputs))
        with self._lock:
            subs = [self._active.get(o.request_id) for o in outputs]
        if before is not None and after is not None and outputs:
            step_joules = max(0.0, after - before)
            if m.joules is not None:
                m.labels(m.joules).inc(step_joules)
            shares = share_energy(step_joules, {o.request_id: o.fed_tokens for o in outputs})
            for sub, output in zip(subs, outputs, strict=True):
                if sub is not None:
                    sub.joules += shares.get(output.request_id, 0.0)
        now = time.perf_counter()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}
        running = self.engine.running_stats() if any(sub is not None and sub.stream for sub in subs) else {}
        for sub, output in zip(subs, outputs, strict=True):
            m.labels(m.tokens_per_step).observe(output.committed)
            if sub is None:  # aborted while the step ran
                continue
            event = self._event(sub, output, now, running)
            if event is not None:
                by_loop.setdefault(sub.loop, []).append((sub.queue, event))
            if output.finished:
                self._finish_times.append(now)
        for loop, events in by_loop.items():
            loop.call_soon_threadsafe(_deliver, events)
        self._update_gauges()
        self._count_prefix_cache()

    def _event(self, sub: Submission, output: StepOutput, now: float,
               running: dict[str, RequestStats]) -> Optional[Event]:
        m = self.metrics
        if sub.first_token is None and (output.new_token_ids or output.result is not None):
            sub.first_token = now
            m.labels(m.ttft).observe(now - sub.submitted)
        if output.result is None:
            if not output.new_token_ids:
                return None
            if sub.stream:
                stats = running.get(output.request_id)
                summary = None if stats is None else DecodingSummary.of(stats, self._joules(sub))
                return Event("delta", sub.choice, ids=output.new_token_ids, logprobs=output.new_logprobs,
                             summary=summary, cached_tokens=output.cached_tokens)
            sub.held.extend(output.new_token_ids)
            sub.held_logprobs.extend(output.new_logprobs)
            return None
        with self._lock:
            self._active.pop(output.request_id, None)
        self._observe_finish(sub, output.result, now)
        ids, logprobs = output.new_token_ids, output.new_logprobs
        if sub.held:
            ids, logprobs = (*sub.held, *ids), (*sub.held_logprobs, *logprobs)
            sub.held, sub.held_logprobs = [], []
        return Event("done", sub.choice, ids=ids, logprobs=logprobs, result=output.result, joules=self._joules(sub),
                     cached_tokens=output.cached_tokens)

    def _joules(self, sub: Submission) -> Optional[float]:
        """The energy measured for this request so far; None without a meter (never an invented 0)."""
        return sub.joules if self.meter.name != "none" else None

    def _observe_finish(self, sub: Submission, result: GenerationResult, now: float) -> None:
        m, stats = self.metrics, result.stats
        m.labels(m.queue_time).observe(stats.queue_time)
        m.labels(m.e2e).observe(now - sub.submitted)
        m.labels(m.nfe).observe(stats.nfe)
        m.labels(m.steps_saved_request).observe(stats.steps_saved)
        m.labels(m.steps_saved).inc(max(0, stats.steps_saved))
        m.labels(m.steps).inc(stats.steps)
        m.labels(m.forced).inc(stats.forced_commits)
        m.labels(m.grinding).inc(stats.grinding_exits)
        if self.meter.name != "none" and m.request_joules is not None:
            m.labels(m.request_joules).observe(sub.joules)

