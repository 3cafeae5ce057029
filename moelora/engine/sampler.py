"""Batched token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds, logit adjustments
(logit_bias, min_tokens, allowed_token_ids, bad words, penalties).

Shape legend: B rows (one per sequence), V vocab. `sample(logits [B, V] fp32, params, gens)`.
Sampling is the exponential-race form of a categorical draw (argmax of p / q with q ~ Exp(1)),
so greedy and sampled rows share one argmax; each row draws its noise from its own generator,
which makes a seeded request reproducible whatever it is batched with.

Penalties (`SamplingParams.penalized`): a request keeps a `PenaltyState` on the device (its output
token counts and which tokens its prompt or output hold), created at its first sampled token and
updated by `record_tokens` right after each draw, on the device: no host sync, and overlapped
scheduling's next step sees the token before it is read back. `adjust_logits` returns the logits
sampling draws from (logit_bias, min_tokens, penalties); logprobs stay the model's own distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moelora.engine.request import SamplingParams
from moelora.upload import upload


@dataclass
class PenaltyState:
    counts: torch.Tensor  # [V] int32: times each token was generated
    seen: torch.Tensor  # [V] bool: in the prompt or generated (repetition_penalty's set)

    @staticmethod
    def new(prompt_ids: Sequence[int], vocab: int, device: torch.device) -> PenaltyState:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[upload([t for t in prompt_ids if 0 <= t < vocab], torch.long, device)] = True
        return PenaltyState(torch.zeros(vocab, dtype=torch.int32, device=device), seen)


def adjust_logits(logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                  states: Sequence[PenaltyState | None], suppress: Sequence[Sequence[int]],
                  outputs: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """logits [B, V] -> a new fp32 [B, V] for sampling, in vLLM's order: rows[i] gets params[i]'s
    allowed_token_ids (-inf on every other token), logit_bias, -inf on the token ids suppress[i] (min_tokens not
    reached) and on its bad words' last tokens where outputs[i] (the output so far) ends with the rest of the word,
    then its penalties (states[i], not None when params[i].penalized; see SamplingParams)."""
    out = logits.float().clone()
    dev, V = logits.device, logits.shape[1]
    for r, p in zip(rows, params, strict=True):
        if p.allowed_token_ids is not None:
            keep = upload([t for t in p.allowed_token_ids if t < V], torch.long, dev)
            row = torch.full((V,), float("-inf"), device=dev)
            out[r] = row.index_copy_(0, keep, out[r].index_select(0, keep))
    cells = [(r, t, b) for r, p in zip(rows, params, strict=True) for t, b in p.logit_bias if t < V]
    cells += [(r, t, float("-inf")) for r, ids in zip(rows, suppress, strict=True) for t in ids if 0 <= t < V]
    cells += [(r, t, float("-inf")) for r, t in _banned(rows, params, outputs) if t < V]
    if cells:
        r_idx, t_idx, vals = zip(*cells, strict=True)  # sparse: only the named cells are touched
        at = upload([r_idx, t_idx], torch.long, dev)
        out.index_put_((at[0], at[1]), upload(vals, torch.float32, dev), accumulate=True)
    pen = [j for j, p in enumerate(params) if p.penalized]
    if pen:
        index = upload([rows[j] for j in pen], torch.long, dev)
        x = out.index_select(0, index)
        counts = torch.stack([states[j].counts for j in pen]).float()
        seen = torch.stack([states[j].seen for j in pen])
        rep, freq, pres = upload([[params[j].repetition_penalty, params[j].frequency_penalty,
                                   params[j].presence_penalty] for j in pen], torch.float32, dev).t()[:, :, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0).float()
        out.index_copy_(0, index, x)
    return out


def _banned(rows: Sequence[int], params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]] | None):
    """(row, token) pairs a bad word bans now: its last token, where the output ends with the word's other tokens."""
    for i, (r, p) in enumerate(zip(rows, params, strict=True)):
        for word in p.bad_words_ids:
            head = word[:-1]
            if not head or (outputs is not None and len(outputs[i]) >= len(head)
                            and tuple(outputs[i][len(outputs[i]) - len(head):]) == head):
                yield r, word[-1]


def record_tokens(tokens: torch.Tensor, rows: Sequence[int], states: Sequence[PenaltyState]) -> None:
    """Count each penalized row's sampled token (tokens [B] on the device; no sync)."""
    one = torch.ones(1, dtype=torch.int32, device=tokens.device)
    for i, st in zip(rows, states, strict=True):
        tok = tokens[i:i + 1]
        st.counts.index_add_(0, tok, one)
        st.seen.index_fill_(0, tok, True)


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then vLLM's order: min_p (on the tempered probabilities), top-k, top-p."""
    B, V = logits.shape
    logits = logits / _temperatures(logits, params)
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(-1)
        min_ps = upload([p.min_p for p in params], None, logits.device)
        logits = logits.masked_fill(probs < min_ps[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    ks = upload([p.top_k if 0 < p.top_k < V else V for p in params], None, logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    drop = rank >= ks[:, None]
    probs = sorted_logits.softmax(-1)
    top_ps = upload([p.top_p for p in params], None, logits.device)
    drop |= (probs.cumsum(-1) - probs) >= top_ps[:, None]  # keep the smallest prefix reaching top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64, on logits' device)."""
    logits = logits.float()
    if all(p.greedy for p in params):  # the common decode case: no sort, no noise
        return logits.argmax(-1)
    greedy = upload([p.greedy for p in params], None, logits.device)
    needs_filter = any(p.top_p < 1 or p.top_k > 0 or p.min_p > 0 for p in params)
    probs = (_filter(logits, params) if needs_filter else logits / _temperatures(logits, params)).softmax(-1)
    noise = torch.empty_like(probs).exponential_()  # one draw for all unseeded rows
    for i, g in enumerate(generators):
        if g is not None:  # seeded rows draw from their own generator: reproducible in any batch
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), sampled)


def _temperatures(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    return upload([p.temperature if p.temperature > 0 else 1.0 for p in params], None, logits.device)[:, None]


def logprobs_on_device(logits: torch.Tensor, tokens: torch.Tensor, wants: Sequence[int | None]):
    """Per row i with `wants[i]` not None: the logprob of `tokens[i]`, its rank (1: the most likely)
    and the `wants[i]` most likely tokens, from the model's own distribution (before temperature,
    top-k, top-p). Computed on the device with no sync; `logprobs_to_host` reads it back later, so
    the logits buffer may be overwritten in between (a CUDA graph's static output)."""
    rows = [i for i, k in enumerate(wants) if k is not None]
    if not rows:
        return (list(wants), rows, None, None, None, None)
    index = upload(rows, None, logits.device)
    lp = logits.index_select(0, index).float().log_softmax(-1)
    chosen = lp.gather(1, tokens.index_select(0, index)[:, None])
    rank = (lp > chosen).sum(-1) + 1
    k = max(wants[i] for i in rows)
    top_lp, top_id = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return (list(wants), rows, chosen[:, 0], rank, top_lp, top_id)


def logprobs_to_host(pending) -> list:
    """Per row: None where nothing was asked, else (logprob, rank, ((id, logprob), ...))."""
    wants, rows, chosen, rank, top_lp, top_id = pending
    out: list = [None] * len(wants)
    if not rows:
        return out
    chosen, rank, top_lp, top_id = chosen.tolist(), rank.tolist(), top_lp.tolist(), top_id.tolist()
    for j, i in enumerate(rows):
        out[i] = (chosen[j], rank[j], tuple(zip(top_id[j][:wants[i]], top_lp[j][:wants[i]], strict=True)))
    return out
