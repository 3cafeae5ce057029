"""`Shard`: one rank's place in the group and the collectives the model calls (in its forward only).

Shape legend: T tokens, H hidden, V vocab, Vr a rank's vocab rows (padded). `all_reduce(partial)` sums a
partial sum [T, H] the calling layer has just produced and no one else holds (a row-parallel projection's,
or an MoE block's routed + shared output): it is reduced in that tensor, as the base GEMM's output buffer,
which is the one collective of the site (LoRA's (x_i A_i) B is already in it, contract 9).
`gather_vocab(local [T, Vr]) -> [T, V]` concatenates every rank's vocab rows (on all ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moelora.parallel.rules import Cut, ShardPlan


@dataclass(frozen=True)
class Shard:
    plan: ShardPlan
    group: Any = None  # the device ProcessGroup (NCCL on CUDA, gloo on CPU); None for one rank

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def size(self) -> int:
        return self.plan.size

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `partial`, written over `partial` and returned. Contract 2: callers pass
        only a tensor they produced for this (a layer's fresh output, read by nothing else before the sum),
        never one of their inputs; the callers are DecoderLayer, VocabParallelEmbedding, ShardedRMSNorm."""
        if self.group is None:
            return partial
        self.group.allreduce([partial]).wait()
        return partial

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's `t` into every rank's `t` (same shape on all; the step's token ids, a buffer the receiving
        rank owns)."""
        if self.group is None:
            return
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        if self.group is None:
            return local[:, :vocab_size]
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self.group.allgather([parts], [local.contiguous()]).wait()
        return torch.cat(parts, dim=1)[:, :vocab_size]


def apply_cut(full: torch.Tensor, cut: Cut | None) -> torch.Tensor:
    """The rank's part of `full` (a copy only when a dim keeps several ranges)."""
    if cut is None:
        return full
    for dim, ranges in cut:
        parts = [full.narrow(dim, a, b - a) for a, b in ranges]
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return full
