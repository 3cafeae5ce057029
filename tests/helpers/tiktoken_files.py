"""A Kimi-style tokenizer directory for tests: `tiktoken.model` (a small byte-level BPE trained here on a text),
`tokenization_kimi.py` holding `pat_str` as Kimi-K2's repository writes it (a class attribute, "|".join of raw
string literals), `tokenizer_config.json` naming some of the 256 special ids after the vocabulary."""

from __future__ import annotations

import base64
import collections
import json
import re
from pathlib import Path

# Kimi-K2's pre-tokenizer regex (its tokenization_kimi.py): Han runs apart, words with their case pieces and
# English contractions, numbers in threes, punctuation runs, then whitespace
KIMI_PATTERN = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 5: "<|im_middle|>"}
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + m['content']"
                 " + '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant"
                 "<|im_middle|>{% endif %}")
TEXT = ("The quick brown fox jumps over the lazy dog; it's 2048 tokens of MoE LoRA serving, isn't it? "
        "Mixture-of-Experts models route each token to a few experts. 混合专家模型把每个词元路由到少数专家。"
        "DeepSeek, Qwen, GLM and Kimi ship FP8 weights: 1234567 bytes, 3.14159 and x_y.z!\n\n\tIndented line.\n")


def train_ranks(text: str, size: int) -> dict[bytes, int]:
    """A byte-level BPE of `size` tokens: the 256 bytes, then the most frequent adjacent pair within words, merged
    one at a time (ties: the first seen)."""
    words = collections.Counter(re.findall(r"\s?\w+|\s?[^\w\s]+|\s+", text))
    pieces = {w: [bytes([b]) for b in w.encode()] for w in words}
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < size:
        pairs = collections.Counter()
        for w, n in words.items():
            for pair in zip(pieces[w], pieces[w][1:], strict=False):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        for w, seq in pieces.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            pieces[w] = out
    return ranks


def scrambled(ranks: dict[bytes, int], seed: int, words: int = 40) -> dict[bytes, int]:
    """`ranks` with the merged tokens' ranks shuffled (so the order of merges is not the order they were learnt in,
    as in real vocabularies) and `words` whole words of TEXT added that no merge reaches (tiktoken takes a pre-token
    that is a token whole)."""
    import random

    rng = random.Random(seed)
    merged = [t for t in ranks if len(t) > 1]
    extra = [w.encode() for w in dict.fromkeys(re.findall(r" ?[A-Za-z]{6,}", TEXT)) if w.encode() not in ranks]
    merged += rng.sample(extra, min(words, len(extra)))
    rng.shuffle(merged)
    return {**{bytes([b]): b for b in range(256)}, **{t: 256 + i for i, t in enumerate(merged)}}


def write_kimi_tokenizer(out: Path, ranks: dict[bytes, int], config: dict | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (out / "tiktoken.model").write_text("".join(lines))
    parts = "".join(f"            r\"\"\"{p}\"\"\",\n" for p in KIMI_PATTERN)
    (out / "tokenization_kimi.py").write_text(
        "import tiktoken\n\n\nclass TikTokenTokenizer:\n    num_reserved_special_tokens = 256\n"
        f"    pat_str = \"|\".join(\n        [\n{parts}        ]\n    )\n")
    n = len(ranks)
    cfg = {"added_tokens_decoder": {str(n + i): {"content": c, "special": True} for i, c in SPECIAL.items()},
           "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg if config is None else config))
    return out


def tiktoken_encoding(ranks: dict[bytes, int]):
    """tiktoken's own encoder of these ranks, Kimi's pattern and special tokens (the oracle)."""
    import tiktoken

    n = len(ranks)
    specials = {SPECIAL.get(i, f"<|reserved_token_{n + i}|>"): n + i for i in range(256)}
    return tiktoken.Encoding("kimi-test", pat_str="|".join(KIMI_PATTERN), mergeable_ranks=ranks,
                             special_tokens=specials)
