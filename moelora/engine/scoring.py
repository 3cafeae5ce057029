"""Prompt scoring: the logits, or the logprobs, of every position of given token sequences, outside the scheduler's
steps (completions' `echo` with `logprobs` and `prompt_logprobs`, `LLM.logits`, `moelora verify`).

The sequences are packed into forwards (through the piecewise graphs when the engine has them, as its prefill
steps) of at most the step budget (`max_num_batched_tokens`) tokens,
`max_num_seqs` sequences and `max_loras` adapters, in order: many short prompts share a forward (an evaluation
harness's batch of loglikelihood requests costs a few forwards, not one each), and a sequence longer than the budget
is computed over several as chunked prefill, each chunk attending to the KV its earlier chunks wrote. A sequence's
blocks are taken for its whole length when it starts and given back when it is done. The prefix cache is not read
(every position's logits are wanted, so each is computed), but a scored sequence's full blocks are published to it:
the generation that an evaluation harness asks of the same prompt (`echo`, `logprobs`, `max_tokens: 1`) then
computes its last partial block only. Each forward's logits are made `ModelRunner.logit_rows` rows at a time and
handed to the caller's `on_rows`, which keeps what it needs before the next rows are made: scoring 32k positions of
a 152k-token vocabulary holds one chunk of logits (~0.25 GiB), not all of them (~20 GiB).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from moelora.engine.request import Request, SamplingParams, Status
from moelora.engine.sampler import logprobs_on_device, logprobs_to_host
from moelora.engine.scheduler import ScheduledStep
from moelora.errors import RequestError
from moelora.upload import upload

# on_rows(logits [n, V] fp32, the sequence of each row, the position of each row)
RowsFn = Callable[[torch.Tensor, list[int], list[int]], None]


class NoFreeBlocks(RequestError):
    """A sequence's KV blocks are held by running requests right now: it may be scored once they finish."""


def check_sequences(engine, seqs: Sequence[Sequence[int]], adapters: Sequence[str | None]
                    ) -> list[RequestError | None]:
    """Per sequence: None, or why it cannot be scored at all (unknown adapter, length, more KV blocks than
    the cache has)."""
    cfg, blocks = engine.cfg, engine.cache.allocator.num_blocks
    errors: list[RequestError | None] = []
    for i, (ids, name) in enumerate(zip(seqs, adapters, strict=True)):
        need = -(-len(ids) // cfg.block_size)
        if name is not None and name not in engine.pool.names:
            errors.append(RequestError(f"unknown adapter {name!r}; loaded: {engine.pool.names}"))
        elif not ids or len(ids) > cfg.max_model_len:
            errors.append(RequestError(f"sequence {i} has {len(ids)} tokens; allowed 1..{cfg.max_model_len}"))
        elif need > blocks:
            errors.append(RequestError(f"sequence {i} needs {need} KV cache blocks; the cache has {blocks}"))
        else:
            errors.append(None)
    return errors


def score(engine, seqs: Sequence[Sequence[int]], adapters: Sequence[str | None], on_rows: RowsFn
          ) -> list[RequestError | None]:
    """Run every position of each valid sequence through the model (`check_sequences`), calling `on_rows` on
    each chunk of logits rows. Returns per sequence None, or the error that kept it out: `check_sequences`'s,
    or no free KV blocks for it even alone (running requests hold them)."""
    errors = check_sequences(engine, seqs, adapters)
    budget, max_loras = engine.cfg.max_num_batched_tokens, engine.pool.max_loras
    sched = engine.scheduler
    waiting = deque(i for i, e in enumerate(errors) if e is None)
    active: list[Request] = []  # blocks taken, not all positions computed; in order
    seq_of: dict[int, int] = {}
    try:
        while waiting or active:
            reqs, news, names, tokens = [], [], set(), 0
            for req in active:  # a sequence begun goes on first: it holds its blocks
                if tokens == budget:
                    break
                reqs.append(req)
                news.append(min(req.num_tokens - req.num_computed, budget - tokens))
                tokens += news[-1]
                names.add(req.adapter)
            names.discard(None)
            while waiting and tokens < budget and len(reqs) < engine.cfg.max_num_seqs:
                i = waiting[0]
                name = adapters[i]
                if name is not None and name not in names and len(names) == max_loras:
                    break
                req = Request(f"score-{i}", list(seqs[i]), SamplingParams(), name, status=Status.RUNNING,
                              cache_key=engine.pool.cache_key(name))
                if not sched._ensure_blocks(req, req.num_tokens):
                    if reqs:
                        break  # after this forward's sequences give their blocks back
                    errors[waiting.popleft()] = NoFreeBlocks(
                        f"not enough free KV cache blocks for sequence {i} ({len(seqs[i])} tokens) right now")
                    continue
                waiting.popleft()
                active.append(req)
                seq_of[id(req)] = i
                reqs.append(req)
                news.append(min(req.num_tokens, budget - tokens))
                tokens += news[-1]
                if name is not None:
                    names.add(name)
            if not reqs:
                continue
            _forward(engine, reqs, news, [seq_of[id(r)] for r in reqs], on_rows)
            for req, n in zip(reqs, news, strict=True):
                req.num_computed += n
                if req.num_computed == req.num_tokens:
                    sched.register_computed(req)  # its full blocks, for the same prompt's generation next
                    sched.free_blocks(req)
                    active.remove(req)
    finally:
        for req in active:
            sched.free_blocks(req)
    return errors


def _forward(engine, reqs: list[Request], news: list[int], seqs: list[int], on_rows: RowsFn) -> None:
    step = ScheduledStep(reqs, news, [])
    slot_of = engine.pool.acquire(r.adapter for r in reqs)
    inputs = engine.runner.prepare(step, slot_of, engine.pool.slot_ranks)
    row_seq = [s for s, n in zip(seqs, news, strict=True) for _ in range(n)]
    row_pos = [p for r, n in zip(reqs, news, strict=True) for p in range(r.num_computed, r.num_computed + n)]

    def rows(r0: int, logits: torch.Tensor) -> None:
        on_rows(logits, row_seq[r0:r0 + logits.shape[0]], row_pos[r0:r0 + logits.shape[0]])

    pieces = engine.pieces  # the layers through the piecewise graphs, as a prefill step of these rows would run
    if pieces is not None and pieces.can_run(inputs.input_ids.shape[0]):
        engine.runner.all_logits(pieces.hidden_states(inputs), rows)
    else:
        engine.runner.run(inputs, all_logits=True, rows_fn=rows)


def prompt_logits(engine, seqs: Sequence[Sequence[int]], adapters: Sequence[str | None]) -> list[torch.Tensor]:
    """fp32 logits [len, V] of every position of each sequence (all of them held: for short sequences)."""
    out: list[torch.Tensor | None] = [None] * len(seqs)

    def keep(logits: torch.Tensor, row_seq: list[int], row_pos: list[int]) -> None:
        for seq, r0, r1 in _runs(row_seq):
            if out[seq] is None:
                out[seq] = logits.new_empty(len(seqs[seq]), logits.shape[1])
            out[seq][row_pos[r0]:row_pos[r0] + r1 - r0] = logits[r0:r1]

    errors = score(engine, seqs, adapters, keep)
    if any(errors):
        raise next(e for e in errors if e is not None)
    return out


def prompt_logprobs(engine, items: Sequence[tuple[Sequence[int], str | None, int]]) -> list[list | RequestError]:
    """Per (token ids, adapter, k): per prompt token its logprob given the tokens before it, its rank there and
    the k most likely tokens, `(logprob, rank, ((id, logprob), ...))`, the first token `(None, None, ())`; or the
    RequestError that kept that sequence out."""
    seqs = [list(ids) for ids, _, _ in items]
    out = [[(None, None, ())] + [None] * (len(ids) - 1) for ids in seqs]
    kept = []  # per chunk of rows: (its entries on the device, its rows' sequences and positions)

    def reduce(logits: torch.Tensor, row_seq: list[int], row_pos: list[int]) -> None:
        # row p predicts token p + 1: a sequence's last position predicts none of its tokens
        follow = [seqs[s][p + 1] if p + 1 < len(seqs[s]) else 0 for s, p in zip(row_seq, row_pos, strict=True)]
        wants = [items[s][2] if p + 1 < len(seqs[s]) else None for s, p in zip(row_seq, row_pos, strict=True)]
        kept.append((logprobs_on_device(logits, upload(follow, torch.long, logits.device), wants), row_seq, row_pos))

    errors = score(engine, seqs, [a for _, a, _ in items], reduce)
    for pending, row_seq, row_pos in kept:  # read back once all forwards are queued: no sync between chunks
        for s, p, entry in zip(row_seq, row_pos, logprobs_to_host(pending), strict=True):
            if entry is not None:
                out[s][p + 1] = entry
    return [e if e is not None else rows for e, rows in zip(errors, out, strict=True)]


def _runs(row_seq: list[int]):
    """(sequence, first row, end row) of each run of rows of one sequence."""
    r0 = 0
    for r in range(1, len(row_seq) + 1):
        if r == len(row_seq) or row_seq[r] != row_seq[r0]:
            yield row_seq[r0], r0, r
            r0 = r
