"""Rank 0's engine: `start_engine(config)` with `tensor_parallel_size` N > 1 (vLLM's multiprocessing
executor, collective_rpc and per-rank loading, on `torch.distributed`).

Every rank holds its shard of the model and the same scheduler, and runs the same `Engine.step`:
the same requests in the same slots give the same inputs, the all-reduces and gathers give every
rank the same logits, so every rank's decide step commits the same tokens; only rank 0 reports
them. Rank 0 forwards each call that changes state, in order, as one message on each worker's pipe:

- `add_request` / `abort` (any thread) are logged by rank 0's scheduler under its lock, and the log
  goes out as the head of the next step, which the workers replay before stepping. Rank 0 sends
  it from inside its own `schedule()`, holding that lock, so a request added while a step is being
  scheduled goes to the next step on every rank alike;
- a scoring chunk (`ReplicatedScoringJob.advance`) and `collective_rpc` calls.

Sampling: a request that samples without a seed gets one drawn on rank 0 before it is forwarded,
so every rank's generator draws alike; a seeded request gives the same tokens at any N. A mode
that draws whatever the temperature (uniform noise: DiffusionGemma's random canvases and renoise
tokens, `DecodingMode.draws_when_greedy`) gets one for a greedy request too.

A failed step cannot be resynchronised (a rank may be inside a collective the others left), so in
a group it is a fault, as a worker that dies or hangs is (`engine.executor.launch`).
"""

from __future__ import annotations

import itertools
import random
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Optional

import torch

from engine.config import EngineConfig
from engine.decoding.params import DecodeParams
from engine.engine import Engine
from engine.errors import CheckpointError, TensorParallelError
from engine.executor.calls import Replica
from engine.executor.launch import WorkerGroup
from engine.executor.rank import rank_threads
from engine.executor.worker import ModelFactory, rank_model, resolve_call
from engine.loading.checkpoint import CheckpointFiles
from engine.loading.tokenizer import load_tokenizer
from engine.models.parallel.sharding import check_divisible
from engine.models.registry import model_class_for
from engine.request import Request, Resolved
from engine.scheduler import Scheduler
from engine.scoring import ScoringJob

_SEED_BITS = 62  # a drawn sampling seed (DecodeParams.seed takes any integer >= 0)


class ReplicatingScheduler(Scheduler):
    """Rank 0's scheduler: logs every add and abort, and sends the log ahead of each step. It relies
    on `Scheduler` taking `self._lock` in add, abort and schedule (made reentrant here) and on a
    `Request` pickling as it was added (the workers' schedulers take the copies)."""

    def __init__(self, max_batch: int, device: torch.device, move_slot: Callable[[int, int], None],
                 workers: WorkerGroup) -> None:
        super().__init__(max_batch, device, move_slot)
        self._lock = threading.RLock()  # schedule() sends while holding it, then takes it again
        self._log: list[tuple[str, Any]] = []
        self._workers = workers

    def add(self, request: Request) -> None:
        with self._lock:
            super().add(request)
            self._log.append(("add", request))

    def abort(self, request_id: str) -> bool:
        with self._lock:
            known = super().abort(request_id)
            if known:
                self._log.append(("abort", request_id))
            return known

    def schedule(self) -> list[Request]:
        with self._lock:
            log, self._log = self._log, []
            self._workers.send(("step", log))
            return super().schedule()


class ReplicatedScoringJob(ScoringJob):
    """A scoring job whose every forward the workers run with rank 0 (`calls.advance_scoring`)."""

    def __init__(self, workers: WorkerGroup, key: int, model: Any, prompt_ids: Sequence[int], samples: int,
                 seed: int, chunk_tokens: int) -> None:
        super().__init__(model, prompt_ids, samples, seed, chunk_tokens=chunk_tokens)
        self._workers = workers
        self._args = (key, list(prompt_ids), samples, seed, chunk_tokens)

    def advance(self) -> int:
        if self.done:
            return 0
        self._workers.send(("call", "engine.executor.calls:advance_scoring", self._args, False))
        return super().advance()


class TensorParallelEngine(Engine):
    def __init__(self, config: EngineConfig, model_factory: Optional[ModelFactory] = None) -> None:
        """`model_factory` builds each rank's model instead of loading it (`worker.rank_model`)."""
        if model_factory is None:
            checkpoint = CheckpointFiles.open(config.model)
            check_divisible(model_class_for(checkpoint.config).parse_config(checkpoint.config),
                            config.tensor_parallel_size)  # before spawning
        torch.set_num_threads(rank_threads(config))
        self.workers = WorkerGroup.start(config, model_factory)
        try:  # rank 0 builds its shard while the workers build theirs
            model = rank_model(config, 0, model_factory)
            tokenizer: Optional[Any] = None
            if model_factory is None:
                try:
                    tokenizer = load_tokenizer(config.model)
                except CheckpointError:
                    pass
            self.workers.wait_ready()
        except BaseException:
            self.workers.close()
            raise
        self._scoring_keys = itertools.count()
        self._setup(config, model, tokenizer)
        self.replica = Replica(self, 0)
        self.workers.start_monitor()

    @property
    def fault(self) -> Optional[str]:  # type: ignore[override]
        return self.workers.fault

    def close(self) -> None:
        self.workers.close()

    def reset(self) -> None:
        """A failed step cannot be resynchronised (see the module docstring): the group is failed."""
        self.workers.fail_step(sys.exc_info()[1])  # the step's exception, when called while handling it
        super().reset()

    def _make_scheduler(self) -> Scheduler:
        return ReplicatingScheduler(self.max_batch, self.model.device, self.slots.move, self.workers)

    def submit(self, resolved: Resolved, request_id: Optional[str] = None, queued_at: Optional[float] = None) -> str:
        """A request that samples (or whose mode draws even when greedy) without a seed gets one
        drawn here, on rank 0, before it is forwarded: every rank's generator must draw alike
        (drawn per submission: each of a request's `n` choices samples its own)."""
        params = resolved.params
        if params.seed is None and (params.temperature > 0 or self.mode.draws_when_greedy):
            params = replace(params, seed=random.SystemRandom().getrandbits(_SEED_BITS))
            resolved = replace(resolved, params=params)
        return super().submit(resolved, request_id, queued_at)

    def scoring_job(self, prompt_ids: Sequence[int], samples: Optional[int] = None, seed: int = 0) -> ScoringJob:
        ids = [int(t) for t in prompt_ids]
        samples = samples if samples is not None else DecodeParams().score_samples
        self.check_score(ids, samples)
        return ReplicatedScoringJob(self.workers, next(self._scoring_keys), self.model, ids, samples, seed,
                                    self.config.score_chunk_tokens)

    def collective_rpc(self, function: str, *args: Any, results: bool = False) -> list[Any]:
        """Run `function` (`module:name`, taking a `Replica` and `args`) on every rank, rank 0 last
        to be asked; with `results`, every rank's return value in rank order (else rank 0's alone)."""
        if self.fault is not None:
            raise TensorParallelError(self.fault)
        self.workers.send(("call", function, args, results))
        value = resolve_call(function)(self.replica, *args)
        return [value, *self.workers.results()] if results else [value]
