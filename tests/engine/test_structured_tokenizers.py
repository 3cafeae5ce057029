"""Structured outputs over tokenizers with merges (engine/structured.py's vocabulary, its type as xgrammar reads
it): a GPT-2-style byte-level BPE and a SentencePiece-style Metaspace BPE with byte fallback, trained here on a small
corpus. Random walks through each format's allowed tokens end in text that Python's strict json.loads (and re) accept
- raw control characters included, which xgrammar 0.2.9 lets into length-limited strings (maxLength / minLength)."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from moelora.engine.structured import Grammars, StructuredOutput
from moelora.engine.tokenizer import Tokenizer

tokenizers = pytest.importorskip("tokenizers")

CORPUS = ['{"name": "Ada", "age": 36, "tags": ["x", "y"]}', "the quick brown fox jumps over the lazy dog",
          '{"city": "Paris", "temp": -3.5, "ok": true}', "hello world, hello json: [1, 2, 3]\tend\n"] * 50


def byte_level():
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def metaspace():
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=[
        "<eos>", *(f"<0x{b:02X}>" for b in range(256))]))
    return tok


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"},
                                          "ok": {"type": "boolean"}},
          "required": ["name", "n"], "additionalProperties": False}
FORMATS = {
    "schema": (StructuredOutput.of("json", SCHEMA), lambda o: set(o) <= {"name", "n", "ok"} and type(o["n"]) is int
               and len(o["name"]) <= 6),
    "object": (StructuredOutput.of("json_object", None), lambda o: isinstance(o, dict)),
    "regex": (StructuredOutput.of("regex", r"[a-z]{2,5}-[0-9]+"), None),
}


@pytest.mark.parametrize("make", [byte_level, metaspace])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_random_walks_through_the_masks_end_in_valid_text(make, fmt, tmp_path):
    make().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    tok = Tokenizer(tmp_path)
    grammars = Grammars(tok, tok.vocab_size + 5, {tok.eos_token_id})  # logits wider than the vocabulary
    so, check = FORMATS[fmt]
    rng, ended = random.Random(0), 0
    for _ in range(20):
        m, out = grammars.matcher(so), []
        for _ in range(300):
            allowed = grammars.allowed([m], torch.device("cpu"), [0] if so.is_json else None)[0]
            assert not allowed[tok.vocab_size:].any()  # ids past the tokenizer's: never
            tok_id = rng.choice(allowed.nonzero().flatten().tolist())
            assert m.accept_token(tok_id)
            if tok_id == tok.eos_token_id:
                break
            out.append(tok_id)
        if m.is_terminated():
            ended += 1
            text = tok.decode(out)
            if so.is_json:
                assert check(json.loads(text)), text  # strict: raw control characters refused
            else:
                assert re.fullmatch(r"[a-z]{2,5}-[0-9]+", text), text
    assert ended >= 8  # a random walk does close most of them
