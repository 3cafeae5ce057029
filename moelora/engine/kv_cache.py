"""Paged KV cache: fixed-size blocks, a block allocator with reference counts, a prefix cache.

Shape legend: L layers, NB blocks, BS block size (tokens), N_kv kv heads, D head_dim.
Device storage is one (k, v) pair of [NB, BS, N_kv, D] per layer, allocated once. The allocator
is host-only logic (unit-tested without a GPU).

Prefix caching: a full block is keyed by (adapter key, the hash of the previous block, its
token ids). The adapter is part of the key because every layer's K/V depends on the adapter
(LoRA on q/k/v and on every earlier layer), so two adapters never share KV. A block whose
refcount drops to zero stays cached (and reusable) until the allocator needs it, oldest first.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict

import torch

from moelora.errors import CapacityError


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise CapacityError(f"KV cache needs >= 1 block of >= 1 token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2...
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> prefix hash, for cached blocks
        self._cached: dict[int, int] = {}  # prefix hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref 0, LRU first
        self.reserved: list[int] = []  # blocks out of circulation for good (`reserve`)

    def reserve(self) -> int:
        """Take a never-used block out of circulation for good (the decode graphs' padding rows write
        there): neither free nor in use, and `num_blocks`, the blocks requests can hold, drops by one.
        (It was allocated like a request's block, so an idle engine showed one block in use forever.)"""
        if not self._free or self.num_blocks < 2:
            raise CapacityError(f"no block left to reserve ({self.num_blocks} blocks, {len(self._free)} never used)")
        block = self._free.pop()
        self.reserved.append(block)
        self.num_blocks -= 1
        return block

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (never-used plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
        else:
            raise CapacityError("out of KV cache blocks")
        self._ref[block] = 1
        return block

    def free(self, block: int) -> None:
        assert self._ref[block] > 0, f"double free of block {block}" + (" (reserved)" if block in self.reserved else "")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def lookup(self, prefix_hash: int) -> int | None:
        """A cached block for this prefix hash, with its refcount taken, or None."""
        block = self._cached.get(prefix_hash)
        if block is None:
            return None
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1
        return block

    def check(self, held: Counter) -> None:
        """Invariant (tests, debugging): `held` (block -> how many live requests hold it) accounts for every
        reference; a block with none is exactly once either free or (cached) evictable. AssertionError
        naming the first blocks that disagree otherwise."""
        free, evictable = Counter(self._free), set(self._evictable)
        bad = []
        for block in sorted(set(range(len(self._ref))) - set(self.reserved)):
            ref, where = self._ref[block], free[block] + (block in evictable)
            if ref != held.get(block, 0) or where != (ref == 0) or (block in evictable) != (
                    ref == 0 and block in self._hash_of):
                bad.append(f"block {block}: refcount {ref}, held by {held.get(block, 0)} live requests, "
                           f"{free[block]}x on the free list, {'' if block in evictable else 'not '}evictable")
        bad += [f"reserved block {b} is in circulation" for b in self.reserved if self._ref[b] or free[b] or b in held]
        if bad:
            raise AssertionError(f"KV block accounting broken ({len(bad)} blocks): " + "; ".join(bad[:4]))
        assert self.num_used == len(held), (self.num_used, len(held))

    def register(self, block: int, prefix_hash: int) -> None:
        """Record that `block` holds the full block whose prefix hash is `prefix_hash`."""
        if prefix_hash in self._cached or block in self._hash_of:
            return
        self._cached[prefix_hash] = block
        self._hash_of[block] = prefix_hash


def block_hash(adapter_key, parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((adapter_key, parent, tokens))


class PagedKVCache:
    """Device storage for every layer plus the allocator that hands out its blocks.

    The model declares what one token stores per layer (`model.kv_cache_shapes()`: e.g.
    ((N_kv, D), (N_kv, D)) for GQA keys and values, one latent vector for MLA); each becomes a
    tensor [NB, BS, *shape], allocated once.
    """

    def __init__(self, token_shapes: list[tuple[tuple[int, ...], ...]], num_blocks: int, block_size: int,
                 device, dtype: torch.dtype):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.layers = [tuple(torch.zeros((num_blocks, block_size, *shape), device=device, dtype=dtype)
                             for shape in layer) for layer in token_shapes]

    @staticmethod
    def bytes_per_block(token_shapes: list[tuple[tuple[int, ...], ...]], block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        per_token = sum(math.prod(shape) for layer in token_shapes for shape in layer)
        return per_token * block_size * elem
