"""Kimi-K2's vocabulary (`tiktoken.model`, no tokenizer.json): the tokenizer moelora builds from it encodes as
tiktoken itself does (the oracle: `tiktoken.Encoding` over the same ranks, pattern and special tokens) and decodes
back; a model directory holding it serves text prompts and chat; malformed files are refused by name."""

from __future__ import annotations

import json
import random

import pytest

from moelora.engine.tiktoken_vocab import build_tokenizer, merges_of, read_pattern
from moelora.engine.tokenizer import Tokenizer, has_tokenizer
from moelora.errors import ConfigError
from tests.helpers.tiktoken_files import (
    KIMI_PATTERN,
    SPECIAL,
    TEXT,
    scrambled,
    tiktoken_encoding,
    train_ranks,
    write_kimi_tokenizer,
)

tiktoken = pytest.importorskip("tiktoken")


@pytest.fixture(scope="module")
def ranks():
    return train_ranks(TEXT * 3, 420)


@pytest.fixture(scope="module")
def kimi_dir(ranks, tmp_path_factory):
    return write_kimi_tokenizer(tmp_path_factory.mktemp("kimi"), ranks)


def samples(seed: int, n: int) -> list[str]:
    """Slices of the training text, random strings over letters of both cases, Han, digits, apostrophes,
    punctuation and whitespace runs (where the pattern's alternatives meet), and text around special tokens."""
    rng = random.Random(seed)
    alphabet = "aAbZ 'sTtd\n\r\t  é9870,.!?-_混合专家模型" + "\u0301"
    out = [TEXT[i:i + rng.randint(1, 120)] for i in (rng.randrange(len(TEXT)) for _ in range(n))]
    out += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]
    out += [f"{rng.choice(TEXT.split())}{SPECIAL[rng.randrange(6)]} x{rng.randint(0, 99999)}" for _ in range(n // 4)]
    return out + ["", " ", "\n\n\n", "It'S 'll", "12345678901", "<|reserved_token_430|>"]


def test_encodes_as_tiktoken_does(ranks, kimi_dir):
    tok = Tokenizer(kimi_dir)
    enc = tiktoken_encoding(ranks)
    for text in samples(0, 300):
        want = enc.encode(text, allowed_special="all")
        assert tok.encode(text) == want, text
        assert tok.decode(want, skip_special_tokens=False) == text
    assert tok.vocab_size == len(ranks) + 256
    assert tok.token_id("<|im_end|>") == len(ranks) + 2 and tok.eos_token_id == len(ranks) + 1
    assert tok.token_id(f"<|reserved_token_{len(ranks) + 255}|>") == len(ranks) + 255
    assert tok.added_ids() == set(range(len(ranks), len(ranks) + 256))
    assert tok.decode(enc.encode("[BOS]hi<|im_end|>", allowed_special="all")) == "hi"  # specials skipped


@pytest.mark.parametrize("seed", [1, 2])
def test_encodes_as_tiktoken_does_with_scrambled_ranks(ranks, tmp_path, seed):
    """Merged tokens ranked in another order than they were learnt in, and whole words no merge reaches: the
    merge order and the whole-pre-token rule (`ignore_merges`) are tiktoken's."""
    odd = scrambled(ranks, seed)
    tok = Tokenizer(write_kimi_tokenizer(tmp_path, odd))
    enc = tiktoken_encoding(odd)
    rng = random.Random(seed)
    pieces = [t.decode() for t in odd if len(t) > 2 and t.isascii() and t.strip().isalpha()]
    # runs of tokens glued into one pre-token: merges that compete, whose order decides the split
    texts = samples(seed, 200) + ["".join(rng.sample(pieces, 3)).replace(" ", "") for _ in range(300)]
    assert sum(len(t) > 1 for t in map(enc.decode_single_token_bytes, enc.encode(TEXT))) > 30
    for text in texts:
        assert tok.encode(text) == enc.encode(text, allowed_special="all"), text


def test_the_merges_are_tiktokens_priority(ranks):
    """Every token of two or more bytes is reachable by some merge, and merges come in the order of the rank of what
    they make (tiktoken merges the pair whose concatenation ranks lowest)."""
    merges = merges_of(ranks)
    made = [ranks[a + b] for a, b in merges]
    assert made == sorted(made)
    assert {a + b for a, b in merges} == {t for t in ranks if len(t) > 1}


def test_a_model_directory_with_it_serves_text_and_chat(ranks, kimi_dir, tmp_path):
    """A DeepSeek-V3-architecture model (Kimi-K2's) whose directory has tiktoken.model and no tokenizer.json:
    text prompts are encoded by it, chat goes through tokenizer_config.json's template with its special tokens."""
    import shutil

    from moelora import LLM, SamplingParams
    from tests.helpers.oracle import tiny_hf_model

    n = len(ranks)
    model = tmp_path / "kimi"
    tiny_hf_model("deepseek_v3", seed=3, vocab_size=n + 256, bos_token_id=n, eos_token_id=n + 1).save_pretrained(
        str(model))
    for f in kimi_dir.iterdir():
        shutil.copy(f, model / f.name)
    assert has_tokenizer(model) and not (model / "tokenizer.json").exists()
    llm = LLM(model, device="cpu", dtype="float32", max_loras=0, num_kv_blocks=64, block_size=4)
    enc = tiktoken_encoding(ranks)
    out = llm.generate(["Mixture-of-Experts 混合专家"], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids == enc.encode("Mixture-of-Experts 混合专家")
    assert len(out.token_ids) == 3
    chat = llm.chat([{"role": "user", "content": "it's 42"}], SamplingParams(max_tokens=2, temperature=0))[0]
    want = enc.encode("<|im_user|>user<|im_middle|>it's 42<|im_end|><|im_assistant|>assistant<|im_middle|>",
                      allowed_special="all")
    assert chat.prompt_token_ids == want and want.count(n + 2) == 1
    from moelora.engine.structured import StructuredOutputsParams

    # structured outputs read the built tokenizer (xgrammar's byte-level vocabulary from its JSON)
    held = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate(["Is it?"], held)[0].text in ("yes", "no")


def test_the_pattern_is_read_without_running_the_file(kimi_dir, tmp_path):
    assert read_pattern(kimi_dir) == "|".join(KIMI_PATTERN)
    (tmp_path / "tokenization_x.py").write_text("raise SystemExit('ran')\npat_str = r'\\w+|\\s+'\n")
    assert read_pattern(tmp_path) == r"\w+|\s+"


@pytest.mark.parametrize("source,match", [
    ("pat_str = make_pattern()\n", "not a string literal"),
    ("x = 1\n", "no `pat_str = ...`"),
    (None, "no `pat_str = ...` in a tokenization_"),
    ("pat_str = '[unclosed'\n", "does not compile"),
    ("def broken(:\n", "not Python moelora can parse"),
])
def test_pattern_refusals(ranks, tmp_path, source, match):
    write_kimi_tokenizer(tmp_path, ranks)
    (tmp_path / "tokenization_kimi.py").unlink()
    if source is not None:
        (tmp_path / "tokenization_kimi.py").write_text(source)
    with pytest.raises(ConfigError, match=match):
        Tokenizer(tmp_path)


def test_vocabulary_refusals(ranks, tmp_path):
    write_kimi_tokenizer(tmp_path, ranks)
    good = (tmp_path / "tiktoken.model").read_text()
    no_zero_byte = good.replace("AA== 0\n", "enpfdW51c2Vk 0\n")  # rank 0 names b"zz_unused", not b"\x00"
    for text, match in ((good + "not-base64!! 7\n", "line 421 is not"), (good.replace(" 300\n", " 9999\n"),
                        "ranks must be 0..419"), (no_zero_byte, "every single byte.*first: 0x00")):
        (tmp_path / "tiktoken.model").write_text(text)
        with pytest.raises(ConfigError, match=match):
            Tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text(good)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["7"] = {"content": "<|stray|>"}
    with pytest.raises(ConfigError, match="special token id 7 outside"):
        build_tokenizer(tmp_path, config)
    (tmp_path / "tiktoken.model").unlink()
    assert not has_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="no tokenizer.json \\(nor tiktoken.model\\)"):
        Tokenizer(tmp_path)
