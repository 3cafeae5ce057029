"""Paged attention kernel cases: attention metadata over given block tables, and the whole / worst-row
relative errors (shared by the paged and the MLA attention tests)."""

from __future__ import annotations

import torch

from moelora.layers.attention import AttnMetadata, SeqSlice


def scattered_tables(lengths: list[int], bs: int, spare: int, g: torch.Generator) -> tuple[list[list[int]], int, int]:
    """Block tables for sequences of lengths[i] tokens over a randomly permuted pool with `spare` unused blocks:
    (tables, pool size, the last permuted block id)."""
    nblk = [-(-n // bs) for n in lengths]
    NB = sum(nblk) + spare
    perm = torch.randperm(NB, generator=g).tolist()
    tables, off = [], 0
    for n in nblk:
        tables.append(perm[off:off + n])
        off += n
    return tables, NB, perm[-1]


def build_meta(spec, tables, bs, device, mb=None):
    """spec: [(cached_len, q_len)] per sequence; tables: block ids per sequence (host lists)."""
    seqs, slots, starts = [], [], [0]
    for i, ((ctx, n), row) in enumerate(zip(spec, tables, strict=True)):
        seqs.append(SeqSlice(starts[-1], n, ctx + n, i))
        slots += [row[p // bs] * bs + p % bs for p in range(ctx, ctx + n)]
        starts.append(starts[-1] + n)
    mb = mb or max([len(r) for r in tables] + [1])
    pad = tables[0][0] if tables and tables[0] else 0
    padded = [r + [pad] * (mb - len(r)) for r in tables]  # padding points at a live, random block
    i32 = dict(dtype=torch.int32, device=device)
    return AttnMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, **i32).reshape(len(spec), mb),
        seq_lens=torch.tensor([s.seq_len for s in seqs], **i32),
        query_start=torch.tensor(starts, **i32), seqs=tuple(seqs),
        max_seq_len=max([s.seq_len for s in seqs] + [0]), max_query_len=max([n for _, n in spec] + [0]))


def rel_errors(got, want):
    diff = (got.to(want.dtype) - want)
    whole = (diff.norm() / want.norm()).item() if want.numel() else 0.0
    rows = (diff.norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)).max().item() if want.numel() else 0.0
    return whole, rows
