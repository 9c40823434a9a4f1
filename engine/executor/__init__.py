"""What starts and drives engines: `start_engine(config)` picks the single-device `Engine` or, for
`tensor_parallel_size` > 1, the tensor-parallel one (docs/architecture.md, "Tensor parallelism";
docs/operations.md, "Several GPUs"). It sits above the engine: nothing in the step imports it.

- `start`: the factory;
- `tensor_parallel`: rank 0's engine, which forwards every call that changes state to the workers;
- `launch`: the rendezvous, the worker processes, their liveness monitor and shutdown;
- `worker`: a worker process's loop over the calls rank 0 forwards;
- `calls`: the functions rank 0 runs on every rank at once (`collective_rpc`);
- `rank`: a rank's device, threads and joining the group.
"""
