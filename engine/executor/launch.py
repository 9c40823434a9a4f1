"""Rank 0's side of the group: the rendezvous, the worker processes, their liveness and shutdown.

`WorkerGroup.start` spawns ranks 1..N-1 (`multiprocessing` spawn: a fresh interpreter each, no
inherited CUDA state), each with a pipe to rank 0, then forms the `torch.distributed` group on a
TCP store that rank 0 opens on a free port of 127.0.0.1 (gloo on CPU, NCCL on CUDA, rank r on
cuda:r). Tensors move only through the group's collectives; the pipes carry rank 0's calls (a
step and the requests it admits, a scoring chunk, a heartbeat) and the workers' answers.
A call waits on its pipe as long as the server idles, which a collective could not: every
collective has the group's timeout (`EngineConfig.distributed_timeout`), so a hung peer raises
instead of blocking forever.

Liveness (`_monitor`, a thread): a worker that exits, or that does not answer a heartbeat within the
timeout, is a fault: every worker is stopped and `fault` says why (the server's engine loop sees it,
fails /health and exits non-zero). No orphan on any exit path: `close` (also at interpreter exit)
stops the workers and kills any that do not stop; a worker whose rank 0 is gone exits by itself
(`engine.executor.worker`).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Optional

import torch.distributed as dist

from engine.config import EngineConfig
from engine.errors import TensorParallelError
from engine.executor.rank import HOST, backend, check_devices, init_rank, rendezvous_timeout

log = logging.getLogger("cai_dllm.parallel")

HEARTBEAT_SECONDS = 1.0  # how often rank 0 pings its workers
STOP_GRACE_SECONDS = 10.0  # after "stop", how long a worker may take to exit before it is killed
# A killed peer's sockets close before its process can be reaped, so a collective can fail on rank 0
# (directly, or through a third rank that saw the peer go) an instant before the death is visible.
PEER_EXIT_GRACE_SECONDS = 2.0


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    answered: float = field(default_factory=time.monotonic)  # last message received from it
    error: Optional[str] = None  # the traceback it reported before exiting


class WorkerGroup:
    """Ranks 1..N-1 of a tensor-parallel engine, as rank 0 sees them."""

    def __init__(self, config: EngineConfig, workers: list[_Worker]) -> None:
        self.config = config
        self.workers = workers
        self.fault: Optional[str] = None
        self._results: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._closing = False
        self._lock = threading.Lock()
        self._monitor_thread: Optional[threading.Thread] = None
        atexit.register(self.close)

    # ------------------------------------------------------------------ start-up

    @classmethod
    def start(cls, config: EngineConfig, factory: Optional[tuple[str, dict[str, Any]]] = None) -> WorkerGroup:
        """Spawn ranks 1..N-1 and form the group with this process as rank 0. TensorParallelError
        (with the worker's reason) if a worker fails before it joins."""
        from engine.executor.worker import worker_main

        check_devices(config)
        if dist.is_initialized():  # the group is torch.distributed's default one: one per process
            raise TensorParallelError("this process already holds a tensor-parallel engine (or another "
                                      "torch.distributed group): close it before starting another")
        size = config.tensor_parallel_size
        store = dist.TCPStore(HOST, 0, size, True, wait_for_workers=False, timeout=rendezvous_timeout(config))
        context = multiprocessing.get_context("spawn")
        workers = []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(target=worker_main,
                                      args=(config, rank, store.port, theirs, os.getpid(), factory),
                                      name=f"cai-dllm-tp{rank}", daemon=True)
            process.start()
            theirs.close()
            workers.append(_Worker(rank, process, ours))
        group = cls(config, workers)
        try:
            group._wait_for("spawned", "start")  # a worker that cannot start fails here, not at the rendezvous
            init_rank(config, 0, store.port, store)
        except BaseException:
            group.close()
            raise
        log.info("tensor parallel: %d ranks (%s), workers %s", size, backend(config),
                 ", ".join(f"rank {w.rank} pid {w.process.pid}" for w in workers))
        return group

    def wait_ready(self) -> None:
        """Wait until every worker has loaded its shard (TensorParallelError if one fails)."""
        self._wait_for("ready", "load its shard of the model")

    def _wait_for(self, answer: str, doing: str) -> None:
        waiting = {w.rank: w for w in self.workers}
        while waiting:
            ready = wait([w.conn for w in waiting.values()] + [w.process.sentinel for w in waiting.values()])
            for worker in list(waiting.values()):
                if worker.conn in ready:
                    try:
                        message = worker.conn.recv()
                    except (EOFError, OSError):
                        message = ("error", "it closed its pipe")
                    if message[0] == answer:
                        del waiting[worker.rank]
                        continue
                    worker.error = message[1] if message[0] == "error" else f"unexpected message {message[0]!r}"
                elif worker.process.sentinel not in ready:
                    continue
                worker.process.join(STOP_GRACE_SECONDS)
                raise TensorParallelError(f"tensor-parallel worker rank {worker.rank} failed to {doing}: "
                                          f"{worker.error or f'it exited with code {worker.process.exitcode}'}")

    def start_monitor(self) -> None:
        now = time.monotonic()
        for worker in self.workers:  # their load may have taken longer than the timeout
            worker.answered = now
        self._monitor_thread = threading.Thread(target=self._monitor, name="cai-dllm-tp-monitor", daemon=True)
        self._monitor_thread.start()

    # ------------------------------------------------------------------ calls

    def send(self, message: tuple) -> None:
        """Send a call to every worker, in rank order (a worker gone is the monitor's to report)."""
        for worker in self.workers:
            with worker.send_lock:
                try:
                    worker.conn.send(message)
                except (BrokenPipeError, ConnectionResetError, OSError) as err:
                    self.fail(f"tensor-parallel worker rank {worker.rank} cannot be reached: {err}")
                    raise TensorParallelError(self.fault or str(err)) from None

    def results(self) -> list[Any]:
        """Every worker's answer to the last call that asked for one, in rank order."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + self.config.distributed_timeout
        while len(answers) < len(self.workers):
            if self.fault is not None:
                raise TensorParallelError(self.fault)
            try:
                rank, value = self._results.get(timeout=min(HEARTBEAT_SECONDS, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise TensorParallelError("the tensor-parallel workers did not answer within "
                                              f"{self.config.distributed_timeout:g} s") from None
                continue
            answers[rank] = value
        return [answers[w.rank] for w in self.workers]

    # ------------------------------------------------------------------ faults and shutdown

    def fail(self, reason: str) -> None:
        """The group cannot go on: record why (once; the engine reports it as `Engine.fault`) and
        stop every worker."""
        with self._lock:
            if self.fault is not None or self._closing:
                return
            self.fault = reason
        log.error("tensor parallel: %s; stopping every worker", reason)
        self._stop_workers(grace=0.0)

    def fail_step(self, error: Optional[BaseException]) -> None:
        """A step failed on rank 0: a fault, blamed on a worker that has exited if there is one (its
        death is what broke the step's collective; it is waited for briefly, see PEER_EXIT_GRACE_SECONDS)."""
        wait([w.process.sentinel for w in self.workers], timeout=PEER_EXIT_GRACE_SECONDS)
        dead = [w for w in self.workers if not w.process.is_alive()]
        if dead:  # a rank killed by a signal broke the step; its peers' failed collectives followed
            self.fail(self._exited(min(dead, key=lambda w: (w.process.exitcode or 0) >= 0)))
            return
        cause = f" ({type(error).__name__}: {error})" if error is not None else ""
        self.fail(f"a step failed on rank 0{cause}; the tensor-parallel ranks cannot be brought back into step")

    def close(self) -> None:
        """Stop every worker (asked first, killed if it does not stop) and leave the group. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        for worker in self.workers:
            with worker.send_lock:
                try:
                    worker.conn.send(("stop",))
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass
        self._stop_workers(grace=STOP_GRACE_SECONDS)
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit.unregister(self.close)

    def _stop_workers(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join(STOP_GRACE_SECONDS)

    def _monitor(self) -> None:
        """Read the workers' answers; a worker that exits or stops answering is a fault."""
        sentinels = {w.process.sentinel: w for w in self.workers}
        conns = {w.conn: w for w in self.workers}
        pinged = time.monotonic()
        while not self._closing and self.fault is None:
            ready = wait([*conns, *sentinels], timeout=HEARTBEAT_SECONDS)
            for item in ready:
                worker = conns.get(item)  # type: ignore[call-overload]
                if worker is not None:
                    self._receive(worker)
            for item in ready:
                worker = sentinels.get(item)  # type: ignore[call-overload]
                if worker is not None and not self._closing:
                    while worker.conn.poll():  # its last words (a traceback) come before its exit
                        if not self._receive(worker):
                            break
                    self.fail(self._exited(worker))
                    return
            now = time.monotonic()
            silent = [w for w in self.workers if now - w.answered > self.config.distributed_timeout]
            if silent and not self._closing:
                worker = silent[0]
                self.fail(f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) has not answered "
                          f"for {now - worker.answered:.0f} s (--distributed-timeout "
                          f"{self.config.distributed_timeout:g}): it hangs")
                return
            if now - pinged >= HEARTBEAT_SECONDS:
                pinged = now
                for worker in self.workers:
                    with worker.send_lock:
                        try:
                            worker.conn.send(("ping",))
                        except (BrokenPipeError, ConnectionResetError, OSError):
                            pass  # its exit is reported through its sentinel

    @staticmethod
    def _exited(worker: _Worker) -> str:
        worker.process.join(STOP_GRACE_SECONDS)  # its sentinel fires as it exits: reap it for its code
        return (f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) exited with code "
                f"{worker.process.exitcode}" + (f": {worker.error}" if worker.error else ""))

    def _receive(self, worker: _Worker) -> bool:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            return False
        worker.answered = time.monotonic()
        if message[0] == "result":
            self._results.put((worker.rank, message[1]))
        elif message[0] == "error":
            worker.error = message[1]
        return True
