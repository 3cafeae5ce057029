"""Tokenizer (`tokenizers` library, from tokenizer.json, or built from a tiktoken.model vocabulary:
`tiktoken_vocab`) and chat template (jinja2).

The chat template is the one given (`--chat-template`: a file or the template itself), else
`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` field.
Incremental detokenisation (streamed text, stop strings) lives in
`detokenize.py`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from moelora.errors import ConfigError, RequestError


def resolve_chat_template(value: str | None) -> str | None:
    """`--chat-template` as vLLM reads it: a file's contents, or the value itself when it holds template
    syntax; a value that names no file and holds no template is an error (a mistyped path)."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a file name
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a jinja template")


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether `Tokenizer` finds a vocabulary there: tokenizer.json, or tiktoken.model (Kimi's)."""
    from moelora.engine.tiktoken_vocab import has_vocab

    return (Path(model_dir) / "tokenizer.json").is_file() or has_vocab(model_dir)


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        from moelora.engine.tiktoken_vocab import VOCAB_FILE, build_tokenizer, has_vocab

        model_dir = Path(model_dir)
        cfg_file = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        file = model_dir / "tokenizer.json"
        if file.is_file():
            self._tok = HFTokenizer.from_file(str(file))
        elif has_vocab(model_dir):
            self._tok = build_tokenizer(model_dir, self.config)
        else:
            raise ConfigError(f"no tokenizer.json (nor {VOCAB_FILE}) in {model_dir}")
        template_file = model_dir / "chat_template.jinja"
        self.chat_template = chat_template or (template_file.read_text() if template_file.is_file()
                                               else self.config.get("chat_template"))
        self.eos_token_id = self._token_id(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    def _token_id(self, token) -> int | None:
        text = _token_text(token)
        return None if text is None else self._tok.token_to_id(text)

    def token_id(self, text: str) -> int | None:
        """The id of the vocabulary entry `text` (an added token's content too); None where there is none."""
        return self._tok.token_to_id(text)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: what tokenizer.json's post-processor adds (a BOS, for many models); off by
        default, as a chat template writes its own."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def word_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token id sequences: each word at the text's start and after a space (its two
        tokenizations, where they differ)."""
        out = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.encode(text))
                if ids and ids not in out:
                    out.append(ids)
        return tuple(out)

    def added_ids(self) -> set[int]:
        """The ids of tokenizer.json's added tokens (special and not: chat tags, `<think>`, ...)."""
        return {int(i) for i in self._tok.get_added_tokens_decoder()}

    def spec_json(self) -> str:
        """tokenizer.json's text, as the `tokenizers` library writes it back (xgrammar reads its decoder there)."""
        return self._tok.to_str()

    def decode_each(self, ids) -> list[str]:
        """Each id's text alone, special tokens kept (one batched call)."""
        return self._tok.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def vocab_strings(self, ids: list[int]) -> list[str]:
        """Each id's string in the vocabulary (transformers' convert_ids_to_tokens: byte-level 'Ġ' and all)."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs) -> str:
        """The template rendered in a sandbox, as transformers renders it (its `tojson`: plain `json.dumps`,
        not jinja's HTML-escaping one); `tools`: function definitions in OpenAI's shape; `template_kwargs` (a
        request's `chat_template_kwargs`, e.g. enable_thinking) are extra template variables and cannot
        replace the ones set here."""
        if not self.chat_template:
            raise RequestError("this model has no chat template; send a plain prompt instead")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,  # as transformers renders
                                            extensions=["jinja2.ext.loopcontrols", _generation_block()])
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, namespace=_namespace())
        env.filters["tojson"] = _tojson
        fixed = dict(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        try:
            return env.from_string(self.chat_template).render({**template_kwargs, **fixed})
        except jinja2.TemplateError as e:
            raise RequestError(f"chat template failed: {e}") from None


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise RequestError(message)


def _strftime_now(fmt: str) -> str:
    """The template global transformers gives (Llama-style templates date their system prompt)."""
    from datetime import datetime

    return datetime.now().strftime(fmt)


@functools.cache
def _generation_block():
    """The `{% generation %} ... {% endgeneration %}` tag transformers' templates may use to mark the assistant's
    text (its assistant-token masks): here the body renders as it is."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlock


@functools.cache
def _namespace():
    """jinja's `namespace` without underscore-prefixed attributes (transformers' rule: no way to reach an object's
    internals through one)."""
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot set the underscore-prefixed attribute {name!r} on a "
                                "namespace")

    class TemplateNamespace(Namespace):
        def __init__(*args, **kwargs):  # jinja's signature: `namespace(self=...)` stays an attribute
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace
