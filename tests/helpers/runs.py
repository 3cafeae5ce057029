"""Driving a CPU engine in tests: random prompts, a run to completion, greedy decode by full recompute, the
per-row penalty reference; host-only requests and adapters for the scheduler and pool."""

from __future__ import annotations

import torch

from moelora.engine.request import Request, SamplingParams
from moelora.lora.adapter import LoRAAdapter, LoRAWeights


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(1, 14, (), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(eng, ps, names, params) -> list[list[int]]:
    reqs = [eng.add_request(p, params, a) for p, a in zip(ps, names, strict=True)]
    while eng.has_unfinished():
        eng.step()
    return [r.output_ids for r in reqs]


def greedy_by_recompute(eng, prompt, name, n) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(eng.prompt_logits([ids], [name])[0][-1].argmax()))
    return ids[len(prompt):]


def reference_row(logits: torch.Tensor, prompt: list[int], outputs: list[int], p: SamplingParams) -> torch.Tensor:
    """One row, written out: repetition on prompt + outputs (transformers' processor), then the
    OpenAI frequency / presence terms on the outputs."""
    from transformers import RepetitionPenaltyLogitsProcessor

    row = logits.clone()
    seen = prompt + outputs
    if seen:
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([seen]), row[None])[0]
    for tok in set(outputs):
        row[tok] -= p.frequency_penalty * outputs.count(tok) + p.presence_penalty
    return row


def req(i: int, n: int, adapter=None, arrival=None, max_tokens=8) -> Request:
    return Request(f"r{i}", list(range(100 * i, 100 * i + n)), SamplingParams(max_tokens=max_tokens), adapter,
                   arrival=float(i if arrival is None else arrival))


def fake_adapter(name: str, rank: int) -> LoRAAdapter:
    return LoRAAdapter(name, "", {"site": LoRAWeights(torch.ones(rank, 3), torch.ones(3, rank))})
