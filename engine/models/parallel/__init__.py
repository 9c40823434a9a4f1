"""What a model needs to run as one rank of a tensor-parallel group (Megatron-style sharded layers):

- `group`: a rank's place in the group and the collectives its layers call;
- `sharding`: which sizes a group may split, and which slice of each checkpoint tensor a rank loads.

The processes, the rendezvous and the engine that drives the ranks are above the engine, in
`engine.executor`.
"""
