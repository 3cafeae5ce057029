"""A `tokenizers` tokenizer built from a tiktoken BPE file: the vocabulary the Kimi-K2 models ship as `tiktoken.model`,
with no tokenizer.json, their own tokenizer class being repository code (which moelora never runs).

`tiktoken.model`: one token a line, "<base64 of its bytes> <rank>", ranks 0..N-1. tiktoken splits text into
pre-tokens by the regex `pat_str`, takes a pre-token that is itself a token whole, and otherwise merges, from
single bytes up, the adjacent pair whose concatenation has the lowest rank. The same in `tokenizers`: byte-level
BPE over the vocabulary (each byte through GPT-2's byte-to-character table), a merge (a, b) for every token a + b
whose two parts are tokens, in the order of a + b's rank, and `ignore_merges` (a whole pre-token in the vocabulary
is taken as it is); the pre-tokens the pattern's matches, each kept apart ("isolated").

Special tokens follow the vocabulary: ids N .. N + 255 (`RESERVED_SPECIAL`), named by tokenizer_config.json's
`added_tokens_decoder`, the unnamed ones `<|reserved_token_ID|>`, as Kimi's tokenizer names them. `pat_str` is read
from the repository's `tokenization_*.py` by parsing it (a string literal, or `"|".join([...literals])`), never by
running it.
"""

from __future__ import annotations

import ast
import base64
from pathlib import Path

from moelora.errors import ConfigError

VOCAB_FILE = "tiktoken.model"
RESERVED_SPECIAL = 256  # Kimi's `num_reserved_special_tokens`


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b as one printable character (the printable Latin-1 bytes as themselves,
    the rest as 256 + n in byte order), as `tokenizers`' ByteLevel pre-tokenizer writes bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def read_ranks(path: Path) -> dict[bytes, int]:
    """`tiktoken.model`'s tokens and ranks; a malformed line, a rank gap or a missing byte is a ConfigError."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ConfigError(f"{path}: line {n} is not '<base64 token> <rank>': {line[:80]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ConfigError(f"{path}: byte-level BPE needs every single byte as a token; {len(missing)} missing "
                          f"(first: {missing[0]:#04x})")
    return ranks


def read_pattern(model_dir: Path) -> str:
    """`pat_str` of the repository's tokenizer code, parsed as a literal (ConfigError where there is none)."""
    files = sorted(model_dir.glob("tokenization_*.py"))
    for file in files:
        try:
            tree = ast.parse(file.read_text(), str(file))
        except (SyntaxError, ValueError) as e:
            raise ConfigError(f"{file}: not Python moelora can parse for its pat_str ({e})") from None
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pat_str"
                                                    for t in node.targets):
                pattern = _literal_pattern(node.value)
                if pattern is not None:
                    return pattern
                raise ConfigError(f"{file}: pat_str is not a string literal nor '|'.join of literals; moelora reads "
                                  "it without running the file")
    raise ConfigError(f"{model_dir} has {VOCAB_FILE} but no pre-tokenizer pattern: no `pat_str = ...` in "
                      f"{[f.name for f in files] or 'a tokenization_*.py'}")


def _literal_pattern(value: ast.expr) -> str | None:
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return value.value
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "join"
            and isinstance(value.func.value, ast.Constant) and isinstance(value.func.value.value, str)
            and len(value.args) == 1 and not value.keywords and isinstance(value.args[0], (ast.List, ast.Tuple))):
        parts = [p.value for p in value.args[0].elts if isinstance(p, ast.Constant) and isinstance(p.value, str)]
        if len(parts) == len(value.args[0].elts):
            return value.func.value.value.join(parts)
    return None


def special_tokens(config: dict, num_base: int) -> list[str]:
    """The RESERVED_SPECIAL special tokens after the vocabulary, in id order (module docstring)."""
    named = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (str(key).isdigit() and isinstance(content, str)):
            raise ConfigError(f"tokenizer_config.json added_tokens_decoder[{key!r}] must map an id to "
                              f"{{'content': ...}}, got {entry!r}")
        named[int(key)] = content
    stray = sorted(i for i in named if not num_base <= i < num_base + RESERVED_SPECIAL)
    if stray:
        raise ConfigError(f"tokenizer_config.json names special token id {stray[0]} outside the ids after "
                          f"{VOCAB_FILE}'s {num_base} tokens ({num_base}..{num_base + RESERVED_SPECIAL - 1})")
    return [named.get(i, f"<|reserved_token_{i}|>") for i in range(num_base, num_base + RESERVED_SPECIAL)]


def merges_of(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every (a, b) with a, b and a + b tokens, ordered by a + b's rank (then a's): tiktoken's merge priority."""
    found = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            a, b = token[:cut], token[cut:]
            if a in ranks and b in ranks:
                found.append((rank, ranks[a], a, b))
    found.sort()
    return [(a, b) for _, _, a, b in found]


def build_tokenizer(model_dir: str | Path, config: dict):
    """The `tokenizers.Tokenizer` of model_dir's `tiktoken.model` (module docstring); `config`: its
    tokenizer_config.json (special token names, `add_bos_token`)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model_dir = Path(model_dir)
    ranks = read_ranks(model_dir / VOCAB_FILE)
    pattern = read_pattern(model_dir)
    chars = byte_chars()
    text = lambda t: "".join(chars[b] for b in t)  # noqa: E731
    vocab = {text(t): r for t, r in ranks.items()}
    bpe = models.BPE(vocab=vocab, merges=[(text(a), text(b)) for a, b in merges_of(ranks)], ignore_merges=True)
    tok = Tokenizer(bpe)
    try:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    except Exception as e:  # the library's regex engine refused it
        raise ConfigError(f"{model_dir}: pat_str does not compile as a tokenizers regex: {e}") from None
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = special_tokens(config, len(ranks))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if tok.get_vocab_size() != len(ranks) + RESERVED_SPECIAL:  # a special token's text that is a vocabulary token
        raise ConfigError(f"{model_dir}: a special token of tokenizer_config.json repeats a token of {VOCAB_FILE}")
    bos = config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if config.get("add_bos_token") and isinstance(bos, str) and tok.token_to_id(bos) is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def has_vocab(model_dir: str | Path) -> bool:
    return (Path(model_dir) / VOCAB_FILE).is_file()
