"""A contiguous KV cache: one row of `max_len` positions per sequence, per layer.

Shape legend: L layers, Rw rows (sequences), M max length, N_kv kv heads, D head_dim.
This is the foundation's cache; the paged cache of the GPU engine replaces it.
"""

from __future__ import annotations

import torch

from moelora.config import ModelConfig


class ContiguousKVCache:
    def __init__(self, cfg: ModelConfig, rows: int, max_len: int, device, dtype: torch.dtype):
        shape = (rows, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.max_len = max_len
        self.layers = [(torch.zeros(shape, device=device, dtype=dtype),
                        torch.zeros(shape, device=device, dtype=dtype)) for _ in range(cfg.num_layers)]
