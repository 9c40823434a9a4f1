"""Tensor and expert parallelism over `torch.distributed`: one process per device, Megatron-style
sharded layers, every rank running the same deterministic engine step (docs/architecture.md,
"Tensor parallelism"; docs/operations.md, "Several GPUs").

- `group`: a rank's place in the group and the collectives its layers call;
- `sharding`: which sizes a group may split, and which slice of each checkpoint tensor a rank loads;
- `launch`: the rendezvous, the worker processes, their liveness monitor and shutdown;
- `worker`: a worker process's loop over the calls rank 0 forwards;
- `engine`: rank 0's `Engine`, which forwards every call that changes state to the workers.
"""
