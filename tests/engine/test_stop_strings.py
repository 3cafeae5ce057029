"""The engine's stop-string check (`detokenize.StopStrings`): at every token it agrees with searching
the whole output's decode, and it decodes a short window a token, not the whole output."""

from __future__ import annotations

import random

import pytest

from moelora.engine.detokenize import StopStrings, find_stop
from moelora.engine.request import SamplingParams
from moelora.engine.tokenizer import Tokenizer
from tests.helpers.models import engine
from tests.helpers.runs import prompts  # noqa: F401  (module fixture)

DEMO = "moelora/demo/model"  # a byte-level tokenizer: one token per UTF-8 byte


class CountingDecode:
    def __init__(self, decode):
        self.decode, self.ids = decode, 0

    def __call__(self, ids):
        self.ids += len(ids)
        return self.decode(ids)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEMO)


def test_find_stop_respects_floor_and_searched_text():
    assert find_stop("abcXYdef", ("XY", "de")) == 3
    assert find_stop("abcXYdef", ("XY", "de"), floor=5) == 5  # "XY" ends at 5: not after the floor
    assert find_stop("abcXYdef", ("XY",), since=5) == -1  # searched before
    assert find_stop("abcXYdef", ("XY",), since=4) == 3  # it ends past `since`: may straddle it


@pytest.mark.parametrize("seed", range(4))
def test_stop_strings_agree_with_the_whole_decode_at_every_token(tok, seed):
    rng = random.Random(seed)
    words = ["héllo", "wörld", "✓", "日本", "€", "ok", "stop", "st", "op", " ", "\n", "ü€"]
    text = "".join(rng.choice(words) for _ in range(60))
    ids = tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    at = rng.randrange(len(text) // 2, len(text) - 4)  # past any floor below: the text holds a hit
    stops = [text[at:at + rng.randrange(2, 5)], rng.choice(["\n\n", "p ü", "ld✓", "日本€"])]
    min_tokens = rng.choice([0, 5, 40])
    floor = len(tok.decode(ids[:min_tokens]))
    checker = StopStrings(tok.decode, stops, floor)
    for n in range(min_tokens, len(ids) + 1):
        got = checker.found(ids[:n])
        assert got == (find_stop(tok.decode(ids[:n]), stops, floor) >= 0), (n, stops)
        if got:  # the engine stops at the first hit
            break
    assert got, stops  # the hit itself is checked too


def test_stop_strings_decode_a_window_a_token(tok):
    decode = CountingDecode(tok.decode)
    ids = tok.encode("héllo wörld ✓ 日本 € " * 40)  # ~1000 tokens, no stop string
    checker = StopStrings(decode, ("never",))
    for n in range(1, len(ids) + 1):
        assert not checker.found(ids[:n])
    assert decode.ids < 10 * len(ids)  # the whole output each token would be ~len(ids)^2 / 2


def test_engine_stop_string_check_does_not_redecode_the_output(setup):  # noqa: F811
    model, adapters = setup
    eng = engine(model, adapters)
    eng.tokenizer = Tokenizer(DEMO)
    eng.tokenizer.decode = decode = CountingDecode(eng.tokenizer.decode)
    p = prompts(1, model.config.vocab_size, seed=31)[0]
    req = eng.add_request(p, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, stop=("\x00\x00\x00",)),
                          None)
    while eng.has_unfinished():
        eng.step()
    assert req.finish_reason == "length" and len(req.output_ids) == 120
    assert req.text == eng.tokenizer.decode.decode(req.output_ids)
    assert decode.ids < 10 * 120  # windows, plus the whole output once at the end
