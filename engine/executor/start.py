"""`start_engine(config)`: the engine a configuration asks for (vLLM's executor choice, made once
at the top instead of inside the engine)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from engine.config import EngineConfig
from engine.engine import Engine

if TYPE_CHECKING:
    from engine.executor.worker import ModelFactory


def start_engine(config: EngineConfig, model_factory: Optional[ModelFactory] = None) -> Engine:
    """A single-device `Engine`, or rank 0 of a group of `tensor_parallel_size` processes (it starts
    and drives the other ranks itself; `close()` stops them). `model_factory` builds each rank's
    model instead of loading the checkpoint (tensor-parallel only: the benchmarks' random shards)."""
    if config.tensor_parallel_size > 1:
        # imported here: a one-device engine never loads torch.distributed and the process machinery
        from engine.executor.tensor_parallel import TensorParallelEngine

        return TensorParallelEngine(config, model_factory)
    if model_factory is not None:
        raise ValueError("model_factory builds the ranks of a tensor-parallel group: set tensor_parallel_size > 1")
    return Engine(config)
