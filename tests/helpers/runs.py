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


def scoring_beside_decodes(make, ps, names, seqs, snames, max_tokens: int, every: int = 3) -> tuple[float, float]:
    """Prompt scoring (`prompt_logprobs_batch`, k 2) between the steps of greedy decodes on `make()` (an engine with
    fewer slots than adapters, so the scoring's forwards move adapters in and out of the slots the decodes read):
    the decodes' tokens equal a run on `make()` that never scored. Returns two largest |logprob differences|:
    - `same`: the decodes' sampled tokens against that run's, and every round's scores against the same scoring on
      a `make()` that never decoded (the same forwards, so the same kernels: what is left is the slots' traffic);
    - `own`: every round's scores against each sequence's logits from one forward of its own
      (`make(max_num_batched_tokens=...)`): a forward of another size, which may take other kernels (the dense
      LoRA's rows path at <= 16 rows where the packed forward takes the lanes), so in bf16 a rounding apart."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    ref = make()
    want = [ref.add_request(p, params, a) for p, a in zip(ps, names, strict=True)]
    while ref.has_unfinished():
        ref.step()
    batch = [(s, n, 2) for s, n in zip(seqs, snames, strict=True)]
    alone = make().prompt_logprobs_batch(batch)
    eng = make()
    got = [eng.add_request(p, params, a) for p, a in zip(ps, names, strict=True)]
    rounds, steps = [], 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps % every == 1:
            rounds.append(eng.prompt_logprobs_batch(batch))
    same = 0.0
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids, f"tokens diverge for {g.request_id} ({g.adapter})"
        same = max(same, max(abs(a[0] - b[0]) for a, b in zip(g.logprobs, w.logprobs, strict=True)))
    assert len(rounds) >= 2
    own = 0.0
    whole = make(max_num_batched_tokens=max(len(s) for s in seqs))
    for i, (s, n) in enumerate(zip(seqs, snames, strict=True)):
        lp = whole.prompt_logits([s], [n])[0].float().log_softmax(-1)
        for rows in (r[i] for r in rounds):
            assert len(rows) == len(s) and rows[0] == (None, None, ())
            same = max([same] + [abs(rows[p][0] - alone[i][p][0]) for p in range(1, len(s))])
            own = max([own] + [abs(rows[p][0] - lp[p - 1, s[p]].item()) for p in range(1, len(s))])
    return same, own


def step_with_aborts(eng, abort_after: dict[str, int], max_steps: int = 500) -> None:
    """Step `eng` until nothing is unfinished, checking its block accounting after every step, and abort request
    `rid` after step `abort_after[rid]` (the dict is emptied as they go)."""
    steps = 0
    while eng.has_unfinished():
        eng.step()
        eng.check_blocks()
        steps += 1
        for rid, at in list(abort_after.items()):
            if steps == at:
                eng.abort(rid)
                del abort_after[rid]
        assert steps < max_steps
