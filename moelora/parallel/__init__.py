"""Tensor and expert parallelism over torch.distributed (NCCL on CUDA, gloo on CPU).

`config.py` (ParallelConfig), `rules.py` (what splits where: ShardPlan, ConfigErrors naming the shape that
cannot split), `shard.py` (one rank's place and its collectives), `groups.py` (process-group set-up and
rendezvous), `weights.py` (each rank reads only its slices of the checkpoint), `adapters.py` (an adapter cut
to a rank's shard), `worker.py` (the worker processes' loop), `driver.py` (rank 0: spawn, per-step messages,
faults, shutdown), `engine.py` (the rank-0 engine). See docs/parallel.md.
"""
