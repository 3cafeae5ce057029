"""vLLM's allowed_token_ids and bad_words (tokenized: SamplingParams.bad_words_ids) on the tiny byte-level model, with
overlapped scheduling on: no other token / never the whole word, each checked against the same request without the
rule (which does generate what the rule forbids)."""

from __future__ import annotations

import pytest

from moelora.engine.request import SamplingParams
from moelora.errors import RequestError
from tests.helpers.server import byte_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return byte_engine(tmp_path_factory.mktemp("token_limits"))


def run(eng, items) -> list:
    reqs = [eng.add_request(prompt, params) for prompt, params in items]
    while eng.has_unfinished():
        eng.step()
    eng.check_blocks()
    return reqs


def contains(seq, word) -> bool:
    return any(tuple(seq[i:i + len(word)]) == word for i in range(len(seq) - len(word) + 1))


PROMPTS = [f"text {i}:" for i in range(6)]


def test_allowed_token_ids_are_the_only_tokens(engine):
    allowed = tuple(range(ord("a"), ord("f")))  # "abcde", no EOS: every request runs to max_tokens
    free = run(engine, [(p, SamplingParams(max_tokens=16, temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)])
    held = run(engine, [(p, SamplingParams(max_tokens=16, temperature=1.0, seed=i, allowed_token_ids=allowed))
                        for i, p in enumerate(PROMPTS)])
    assert any(t not in allowed for r in free for t in r.output_ids)
    for r in held:
        assert set(r.output_ids) <= set(allowed) and r.finish_reason == "length", r.output_ids
    eos = run(engine, [("x", SamplingParams(max_tokens=16, temperature=0, allowed_token_ids=(*engine.eos,)))])[0]
    assert eos.output_ids == [*engine.eos] and eos.finish_reason == "stop"


def test_bad_words_are_never_generated_whole(engine):
    greedy = SamplingParams(max_tokens=24, temperature=0)
    free = run(engine, [(p, greedy) for p in PROMPTS])
    one = (free[0].output_ids[1],)  # a token the free run generates
    two = tuple(free[1].output_ids[2:4])  # and a pair of them
    banned = run(engine, [(p, SamplingParams(max_tokens=24, temperature=0, bad_words_ids=(one, two)))
                          for p in PROMPTS])
    for r in banned:
        assert one[0] not in r.output_ids and not contains(r.output_ids, two), r.output_ids
    assert banned[1].output_ids[:2] == free[1].output_ids[:2]  # the same up to the ban
    # the pair's first token alone is still allowed somewhere (only the whole word is banned)
    assert any(two[0] in r.output_ids for r in banned) or two[0] == one[0]


def test_bad_token_ids_are_refused(engine):
    with pytest.raises(RequestError, match="allowed_token_ids token id 999"):
        engine.add_request("x", SamplingParams(allowed_token_ids=(1, 999)))
    with pytest.raises(RequestError, match="bad_words token id 999"):
        engine.add_request("x", SamplingParams(bad_words_ids=((999,),)))
    with pytest.raises(RequestError, match="non-empty list"):
        SamplingParams(allowed_token_ids=())
    assert not engine.has_unfinished()


def test_bad_words_as_text_are_tokenized_by_the_engine(engine):
    """vLLM's `SamplingParams(bad_words=[...])`: strings, tokenized at the text's start and after a space."""
    frees = run(engine, [(p, SamplingParams(max_tokens=24, temperature=0)) for p in PROMPTS])
    ascii_ = set(range(ord("0"), ord("z") + 1))
    free, at = next((r, i) for r in frees for i in range(len(r.output_ids) - 1)
                    if {r.output_ids[i], r.output_ids[i + 1]} <= ascii_)  # a two-letter word the model writes
    word = chr(free.output_ids[at]) + chr(free.output_ids[at + 1])
    banned = run(engine, [(free.prompt, SamplingParams(max_tokens=24, temperature=0, bad_words=[word]))])[0]
    assert word in free.text and word not in banned.text, (free.text, banned.text)
    assert engine.tokenizer.word_ids(["ab"]) == ((ord("a"), ord("b")), (ord(" "), ord("a"), ord("b")))
    with pytest.raises(RequestError, match="non-empty strings"):
        SamplingParams(bad_words=[" "])
