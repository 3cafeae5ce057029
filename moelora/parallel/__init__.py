"""Tensor and expert parallelism over torch.distributed (NCCL on CUDA, gloo on CPU).

`config.py` (ParallelConfig), `rules.py` (what splits where: ShardPlan, ConfigErrors naming the shape that
cannot split), `shard.py` (one rank's place and its collectives), `groups.py` (process-group set-up and
rendezvous), `weights.py` (each rank reads only its slices of the checkpoint), `adapters.py` (an adapter cut
to a rank's shard), `build.py` (a rank's model and KV plan), `wire.py` (a step's packed host inputs),
`worker.py` (the worker processes' loop), `driver.py` (rank 0: spawn, per-step messages, faults, shutdown),
`control.py` (several hosts: the job in the store, TCP control connections), `node.py` (a headless node's ranks),
`engine.py` (the rank-0 engine and its decode graphs). See docs/parallel.md.
"""
