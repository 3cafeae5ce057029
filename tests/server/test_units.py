"""The pieces under the server's streams: incremental detokenisation (UTF-8 split across tokens,
stop strings held back) and the engine's per-token logprobs against a full recompute."""

from __future__ import annotations

import pytest

from moelora.engine.config import EngineConfig
from tests.helpers.server import PROMPTS, byte_tokenizer, make_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("server_units"))


def test_incremental_detokenizer_never_splits_a_character_nor_leaks_a_stop_string():
    from moelora.engine.detokenize import IncrementalDetokenizer

    tok = byte_tokenizer()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    text = "héllo wörld ✓ 日本 done"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) == len(text.encode())  # one token per byte: multi-byte characters span tokens
    detok = IncrementalDetokenizer(decode)
    pieces = [detok.push([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) + detok.finish(None) == text
    stop = "wör"
    held = IncrementalDetokenizer(decode, [stop])
    sent = ""
    for i, t in enumerate(ids):  # as the server does: the token that completes the stop is not pushed
        if stop in decode(ids[:i + 1]):
            break
        sent += held.push([t])
        assert stop[:2] not in sent  # held back: len(stop) - 1 characters
    final = decode(ids[:i + 1])
    final = final[:final.index(stop)]
    assert sent + held.finish(final) == final == "héllo "


def test_engine_logprobs_equal_log_softmax_of_recomputed_logits(assets):
    from moelora.engine.loader import build_engine
    from moelora.engine.request import SamplingParams

    model_dir, adapters = assets
    eng = build_engine(model_dir, EngineConfig(device="cpu", dtype="float32", max_loras=1, max_lora_rank=8,
                                               block_size=4, num_kv_blocks=256))
    eng.pool.add("alpha", adapters["alpha"])
    prompt = eng.tokenizer.encode(PROMPTS[0])
    req = eng.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.7, seed=3, ignore_eos=True,
                                                 logprobs=4), "alpha")
    while eng.has_unfinished():
        eng.step()
    assert len(req.logprobs) == len(req.output_ids) == 5
    logits = eng.prompt_logits([prompt + req.output_ids], ["alpha"])[0]
    ref = logits[len(prompt) - 1:-1].log_softmax(-1)
    for pos, (tok, (chosen, rank, top)) in enumerate(zip(req.output_ids, req.logprobs, strict=True)):
        assert rank == 1 + int((ref[pos] > ref[pos, tok]).sum())
        assert chosen == pytest.approx(ref[pos, tok].item(), abs=1e-4)
        values, ids = ref[pos].topk(4)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
