"""A step's host inputs on the wire: every int list of a `HostStep` in one int64 buffer (one bytes object),
not a pickle of Python ints and named tuples (B=256 decode: ~0.6 KB a list, pickled element by element it cost
~0.5 ms a step on a slow host; packed it is a memcpy). The per-sequence `SeqSlice`s are not sent: they follow
from the query starts and sequence lengths.
"""

from __future__ import annotations

from array import array

from moelora.engine.runner import HostStep
from moelora.layers.attention import SeqSlice


def encode(host: HostStep) -> tuple[bytes, tuple[int, ...], int, int]:
    parts = (*host.lists, host.slots, host.slot_ranks, host.sample_index)
    flat = array("q")
    for part in parts:
        flat.extend(part)
    return flat.tobytes(), tuple(len(p) for p in parts), host.max_blocks, host.max_query_len


def decode(packed: tuple[bytes, tuple[int, ...], int, int]) -> HostStep:
    data, lengths, max_blocks, max_query_len = packed
    flat = array("q")
    flat.frombytes(data)
    parts, at = [], 0
    for n in lengths:
        parts.append(flat[at:at + n].tolist())
        at += n
    *lists, slots, slot_ranks, sample_index = parts
    starts, seq_lens = lists[4], lists[3]
    seqs = tuple(SeqSlice(starts[i], starts[i + 1] - starts[i], seq_lens[i], i) for i in range(len(seq_lens)))
    return HostStep(tuple(lists), slots, slot_ranks, seqs, max_blocks, max_query_len, tuple(sample_index))
