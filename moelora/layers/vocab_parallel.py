"""Vocab-parallel embedding and LM head: each rank holds a block of vocabulary rows.

Shape legend: T tokens, H hidden, V vocab, Vr rows per rank (ceil(V / N); the last rank's block is padded
with zero rows the loader never writes). Rank r holds rows [start, start + Vr).
`VocabParallelEmbedding(ids [T]) -> [T, H]`: the rows this rank holds, zero for the others, all-reduced
(exact: every token's row comes from one rank, the others add zeros). `vocab_parallel_logits(hidden
[T, H], weight [Vr, H]) -> [T, V]`: the local logits, gathered from every rank (all ranks get them; rank 0
samples).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    def __init__(self, start: int, rows: int, hidden: int, shard, dtype: torch.dtype | None = None):
        super().__init__()
        self.start, self.rows, self.shard = start, rows, shard
        self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        rows = F.embedding(local.clamp(0, self.rows - 1), self.weight)
        return self.shard.all_reduce(rows * mine.unsqueeze(1).to(rows.dtype))


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, shard, vocab_size: int) -> torch.Tensor:
    return shard.gather_vocab(F.linear(hidden, weight), vocab_size)
