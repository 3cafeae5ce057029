"""The foundation's generation loop: one static batch, prefill all, then decode together.

Every step builds its inputs, `AttnMetadata` and `LoRABatch` on the host once (contract 4) and
runs the model on all live sequences at once, whatever adapters they name. The continuous-batching
GPU engine (paged cache, scheduler, CUDA graphs) replaces this loop; the model interface stays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moelora.engine.kv_cache import ContiguousKVCache
from moelora.engine.request import RequestOutput, SamplingParams
from moelora.engine.sampler import sample
from moelora.errors import RequestError
from moelora.layers.attention import AttnMetadata, SeqSpan
from moelora.lora.batch import NO_SLOT, LoRABatch


@dataclass
class Sequence_:
    row: int
    prompt_ids: list[int]
    params: SamplingParams
    slot: int
    out: RequestOutput
    generator: torch.Generator | None
    done: bool = False
    cached: int = 0


class Engine:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, slot_ranks: Callable[[], list[int]],
                 eos_token_ids: Sequence[int], decode: Callable[[list[int]], str] | None):
        self.model, self.device, self.dtype = model, device, dtype
        self.slot_ranks = slot_ranks
        self.eos = set(eos_token_ids)
        self.decode = decode
        self.max_len = model.config.max_position_embeddings

    def _step(self, seqs: list[Sequence_], chunks: list[list[int]], cache) -> torch.Tensor:
        """Run one forward over `chunks[i]` new tokens of `seqs[i]`; returns hidden [T, H]."""
        ids, pos, slots, spans, offset = [], [], [], [], 0
        for s, chunk in zip(seqs, chunks, strict=True):
            spans.append(SeqSpan(s.row, s.cached, len(chunk), offset))
            ids += chunk
            pos += range(s.cached, s.cached + len(chunk))
            slots += [s.slot] * len(chunk)
            offset += len(chunk)
            s.cached += len(chunk)
        lora = LoRABatch.build(slots, self.slot_ranks(), self.device) if any(
            x != NO_SLOT for x in slots) else None
        ids_t = torch.tensor(ids, dtype=torch.long).to(self.device)
        pos_t = torch.tensor(pos, dtype=torch.long).to(self.device)
        return self.model(ids_t, pos_t, AttnMetadata(tuple(spans)), cache.layers, lora)

    @torch.inference_mode()
    def logits(self, token_ids: list[list[int]], slots: list[int]) -> list[torch.Tensor]:
        """fp32 logits of every position of every sequence, all in one batch."""
        self._check_lengths([len(t) for t in token_ids])
        seqs = [Sequence_(i, t, SamplingParams(), s, RequestOutput(None, t, None), None)
                for i, (t, s) in enumerate(zip(token_ids, slots, strict=True))]
        cache = ContiguousKVCache(self.model.config, len(seqs), max(len(t) for t in token_ids),
                                  self.device, self.dtype)
        hidden = self._step(seqs, token_ids, cache)
        logits = self.model.logits(hidden).float()
        return list(logits.split([len(t) for t in token_ids]))

    def _check_lengths(self, lengths: list[int]) -> None:
        for i, n in enumerate(lengths):
            if n == 0:
                raise RequestError(f"prompt {i} is empty")
            if n > self.max_len:
                raise RequestError(f"prompt {i} has {n} tokens, more than max_model_len={self.max_len}")

    @torch.inference_mode()
    def generate(self, seqs: list[Sequence_]) -> None:
        self._check_lengths([len(s.prompt_ids) for s in seqs])
        max_len = min(self.max_len, max(len(s.prompt_ids) + s.params.max_tokens for s in seqs))
        cache = ContiguousKVCache(self.model.config, len(seqs), max_len, self.device, self.dtype)
        live, chunks = seqs, [s.prompt_ids for s in seqs]
        while live:
            hidden = self._step(live, chunks, cache)
            last = torch.tensor([c - 1 for c in _cumsum([len(c) for c in chunks])], device=self.device)
            logits = self.model.logits(hidden.index_select(0, last))
            tokens = sample(logits, [s.params for s in live], [s.generator for s in live]).tolist()
            for s, tok in zip(live, tokens, strict=True):
                self._append(s, tok, max_len)
            live = [s for s in live if not s.done]
            chunks = [[s.out.token_ids[-1]] for s in live]

    def _append(self, s: Sequence_, tok: int, max_len: int) -> None:
        p, out = s.params, s.out
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            s.done, out.finish_reason = True, "stop"
        else:
            out.token_ids.append(tok)
            if self.decode is not None:
                out.text = self.decode(out.token_ids)
                cut = min((i for i in (out.text.find(x) for x in p.stop) if i >= 0), default=-1)
                if cut >= 0:
                    out.text, s.done, out.finish_reason = out.text[:cut], True, "stop"
                    return
            if len(out.token_ids) >= p.max_tokens or s.cached >= max_len:
                s.done, out.finish_reason = True, "length"


def _cumsum(xs: list[int]) -> list[int]:
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return out
