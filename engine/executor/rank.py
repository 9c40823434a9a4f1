"""One rank's place in the tensor-parallel group: its device, its threads, and joining the group
(rank 0 and the workers alike; engine.executor.launch starts the workers, engine.executor.worker
runs one)."""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.cpus import default_threads
from engine.errors import TensorParallelError

HOST = "127.0.0.1"  # one host: the group never listens beyond it (docs/operations.md, "Several GPUs")
RENDEZVOUS_SECONDS = 300.0  # forming the group (see rendezvous_timeout)


def rank_device(config: EngineConfig, rank: int) -> str:
    """The device rank `rank` computes on: the CPU, or GPU `rank` (one rank per GPU)."""
    return f"cuda:{rank}" if config.device.startswith("cuda") else "cpu"


def rank_threads(config: EngineConfig) -> int:
    """torch's intra-op threads of each rank: `threads` when set, else an even share of the CPUs
    this process may use (on CPU the ranks share them; on CUDA a rank's threads only feed its GPU)."""
    return config.threads or max(1, default_threads() // config.tensor_parallel_size)


def backend(config: EngineConfig) -> str:
    return "nccl" if config.device.startswith("cuda") else "gloo"


def check_devices(config: EngineConfig) -> None:
    """TensorParallelError unless the group's devices exist: one GPU a rank, counted from cuda:0."""
    size = config.tensor_parallel_size
    if not config.device.startswith("cuda"):
        return
    if config.device not in ("cuda", "cuda:0"):
        raise TensorParallelError(f"with --tensor-parallel-size, rank r runs on cuda:r: give --device cuda, "
                                  f"not {config.device!r} (restrict the GPUs with CUDA_VISIBLE_DEVICES)")
    if not dist.is_nccl_available():
        raise TensorParallelError("--tensor-parallel-size on CUDA needs a PyTorch built with NCCL")
    count = torch.cuda.device_count()
    if count < size:
        raise TensorParallelError(f"--tensor-parallel-size {size} needs {size} CUDA devices, one a rank; "
                                  f"this machine has {count}")


def rendezvous_timeout(config: EngineConfig) -> datetime.timedelta:
    """How long forming the group may take: the ranks' interpreters start at once, but a busy host
    can delay one by many seconds; never less than the collectives' own timeout."""
    return datetime.timedelta(seconds=max(config.distributed_timeout, RENDEZVOUS_SECONDS))


def init_rank(config: EngineConfig, rank: int, port: int, store: Optional[dist.TCPStore] = None) -> None:
    """Join the group as `rank` (rank 0 passes the store it opened), then bound its collectives by
    `distributed_timeout`."""
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
    if store is None:
        store = dist.TCPStore(HOST, port, config.tensor_parallel_size, False, timeout=rendezvous_timeout(config))
    dist.init_process_group(backend(config), store=store, rank=rank, world_size=config.tensor_parallel_size,
                            timeout=rendezvous_timeout(config))
    from torch.distributed import distributed_c10d

    # torch's setter of a formed group's timeout (no public one); without it the rendezvous bound stays
    if hasattr(distributed_c10d, "_set_pg_timeout"):
        distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=config.distributed_timeout))
