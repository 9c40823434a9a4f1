"""A worker process (ranks 1..N-1): its shard of the model, an engine over it, and a loop over the
calls rank 0 forwards.

The worker's engine is a plain `Engine` with a plain scheduler: rank 0 forwards every request it
admits and every abort, in the order its scheduler took them, ahead of the step that follows them
(`engine.executor.tensor_parallel`), so the worker's scheduler holds what rank 0's holds and its
`Engine.step` makes the same decisions on the same logits. It reads its own step summary (a device
read of its own) and returns its outputs to no one; the only answers it sends are heartbeats, the
results of calls that ask for one, and its traceback if it fails, after which it exits non-zero:
rank 0 then stops the group (a step that failed on one rank leaves the collectives out of step).

It exits by itself when rank 0 is gone: its pipe closes (`recv` raises), or, while it is inside a
long load or a collective, a watchdog thread sees its parent change.
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Optional

from engine.config import EngineConfig

_PARENT_POLL_SECONDS = 0.5


def _exit_when_orphaned(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(_PARENT_POLL_SECONDS)


def resolve_call(path: str) -> Any:
    """The function `module:name` a call names (rank 0 runs the same one)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# A rank's model built by a function instead of loaded: `module:function` called with (tp, device,
# **kwargs) on every rank (the benchmarks' random shards, bench/random_models.py)
ModelFactory = tuple[str, dict[str, Any]]


def rank_model(config: EngineConfig, rank: int, factory: Optional[ModelFactory] = None) -> Any:
    """Rank `rank`'s share of the model: loaded from the checkpoint, or built by `factory`."""
    from engine.executor.rank import rank_device
    from engine.loading.weights import load_model
    from engine.models.parallel.group import TensorParallel

    tp = TensorParallel(rank, config.tensor_parallel_size)
    if factory is not None:
        path, kwargs = factory
        return resolve_call(path)(tp, rank_device(config, rank), **kwargs)
    return load_model(config.model, device=rank_device(config, rank), dtype=config.dtype,
                      use_flash_attn=config.use_flash_attn, quantization=config.quantization,
                      quantize_head=config.quantize_head, tp=tp)


def worker_main(config: EngineConfig, rank: int, port: int, conn: Connection, parent: int,
                factory: Optional[ModelFactory] = None) -> None:
    # Ctrl-C reaches the whole process group: rank 0 drains and then stops the workers itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent,), name="cai-dllm-tp-orphan", daemon=True).start()
    code = 0
    try:
        conn.send(("spawned",))
        _serve(config, rank, port, conn, factory)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # rank 0 is gone
        code = 1
    except BaseException:
        code = 1
        try:
            conn.send(("error", traceback.format_exc(limit=8)))
        except (BrokenPipeError, OSError):
            pass
    finally:
        import torch.distributed as dist

        if dist.is_initialized() and code == 0:
            dist.destroy_process_group()
    os._exit(code)  # no interpreter teardown: torch's threads must not outlive a clean exit code


def _serve(config: EngineConfig, rank: int, port: int, conn: Connection, factory: Optional[ModelFactory]) -> None:
    import torch

    from engine.engine import Engine
    from engine.executor.calls import Replica
    from engine.executor.rank import init_rank, rank_threads

    torch.set_num_threads(rank_threads(config))
    init_rank(config, rank, port)
    model = rank_model(config, rank, factory)
    engine = Engine.from_model(model, max_batch=config.max_batch, enable_prefix_caching=config.enable_prefix_caching,
                               prefix_cache_gb=config.prefix_cache_gb)  # every rank caches its own heads alike
    replica = Replica(engine, rank)
    conn.send(("ready",))
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "step":
            scheduler = replica.engine.scheduler
            for op, value in message[1]:
                if op == "add":
                    scheduler.add(value)
                else:
                    scheduler.abort(value)
            replica.engine.step()
        elif kind == "call":
            _, path, args, reply = message
            value = resolve_call(path)(replica, *args)
            if reply:
                conn.send(("result", value))
        elif kind == "ping":
            conn.send(("pong",))
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown call {kind!r} from rank 0")
