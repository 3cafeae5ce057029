"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Shape legend: B rows (one per sequence), V vocab. `sample(logits [B, V] fp32, params, gens)`.
Sampling is the exponential-race form of a categorical draw (argmax of p / q with q ~ Exp(1)),
so greedy and sampled rows share one argmax; each row draws its noise from its own generator,
which makes a seeded request reproducible whatever it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moelora.engine.request import SamplingParams


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    B, V = logits.shape
    logits = logits / _temperatures(logits, params)
    ks = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    drop = rank >= ks[:, None]
    probs = sorted_logits.softmax(-1)
    top_ps = torch.tensor([p.top_p for p in params], device=logits.device)
    drop |= (probs.cumsum(-1) - probs) >= top_ps[:, None]  # keep the smallest prefix reaching top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64, on logits' device)."""
    logits = logits.float()
    if all(p.greedy for p in params):  # the common decode case: no sort, no noise
        return logits.argmax(-1)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    needs_filter = any(p.top_p < 1 or p.top_k > 0 for p in params)
    probs = (_filter(logits, params) if needs_filter else logits / _temperatures(logits, params)).softmax(-1)
    noise = torch.empty_like(probs).exponential_()  # one draw for all unseeded rows
    for i, g in enumerate(generators):
        if g is not None:  # seeded rows draw from their own generator: reproducible in any batch
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), sampled)


def _temperatures(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    return torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=logits.device)[:, None]


def logprobs_on_device(logits: torch.Tensor, tokens: torch.Tensor, wants: Sequence[int | None]):
    """Per row i with `wants[i]` not None: the logprob of `tokens[i]` and the `wants[i]` most likely
    tokens, from the model's own distribution (before temperature, top-k, top-p). Computed on the
    device with no sync; `logprobs_to_host` reads it back later, so the logits buffer may be
    overwritten in between (a CUDA graph's static output)."""
    rows = [i for i, k in enumerate(wants) if k is not None]
    if not rows:
        return (list(wants), rows, None, None, None)
    index = torch.tensor(rows, device=logits.device)
    lp = logits.index_select(0, index).float().log_softmax(-1)
    chosen = lp.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
    k = max(wants[i] for i in rows)
    top_lp, top_id = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return (list(wants), rows, chosen, top_lp, top_id)


def logprobs_to_host(pending) -> list:
    """Per row: None where nothing was asked, else (logprob, ((id, logprob), ...))."""
    wants, rows, chosen, top_lp, top_id = pending
    out: list = [None] * len(wants)
    if not rows:
        return out
    chosen, top_lp, top_id = chosen.tolist(), top_lp.tolist(), top_id.tolist()
    for j, i in enumerate(rows):
        out[i] = (chosen[j], tuple(zip(top_id[j][:wants[i]], top_lp[j][:wants[i]], strict=True)))
    return out
