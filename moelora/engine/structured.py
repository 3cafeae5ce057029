"""Structured outputs: a request's output held to a JSON schema, to any JSON, a regex, a choice of strings or an EBNF
grammar (vLLM's `structured_outputs` / `guided_*`, OpenAI's `response_format`), by xgrammar's token masks.

`StructuredOutput(kind, spec)` rides on `SamplingParams.structured`. `Grammars` (one an engine, over its tokenizer
and the model's vocabulary) compiles each distinct spec once and gives each request its own matcher. Every step the
engine sets a constrained row's logits to -inf at the tokens its grammar does not allow next, after the other
adjustments and before sampling; the sampled token is then fed to the matcher. A complete grammar allows only the
stop tokens (the engine's EOS set), so the request ends by EOS ("stop"), or by length with its output cut short.
Logprobs stay the model's own distribution, as with the other adjustments. Special and added tokens other than the
stop tokens are never allowed (their text is not the model's output). min_tokens does not hold a constrained
request open: the grammar decides where it ends.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from moelora.errors import ConfigError, RequestError
from moelora.upload import upload

KINDS = ("json", "json_object", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)
# JSON's whitespace between tokens: "any" (vLLM's default), "none" (its disable_any_whitespace: no whitespace at all),
# "single" (one space after "," and ":", none elsewhere: forced tool calls, whose JSON only we read; no whitespace
# runaway on a weak model, the spacing models write)
SPACINGS = {"any": dict(any_whitespace=True), "none": dict(any_whitespace=False, separators=(",", ":")),
            "single": dict(any_whitespace=False, separators=(", ", ": "))}
BATCH_FILL_ROWS = 8  # constrained rows from which a step's masks are filled in parallel (`Grammars.allowed`)


@dataclass(frozen=True)
class StructuredOutput:
    """kind "json": `spec` a JSON schema (JSON text); "json_object": a JSON object ("" spec); "regex": a regular
    expression the whole output matches; "choice": a JSON list of the strings the output is one of; "grammar": an
    EBNF grammar (GBNF, root rule `root`). With `after`, the output is free up to and including that token
    (vLLM's structured outputs with a reasoning parser: the reasoning is not held to the format, the answer is)."""

    kind: str
    spec: str = ""
    after: int | None = None  # a token id (a reasoning model's `</think>`) the grammar starts after; None: at once
    spacing: str = "any"  # JSON's whitespace between tokens: any, none (vLLM's disable_any_whitespace), single

    @property
    def is_json(self) -> bool:
        return self.kind in ("json", "json_object")

    def __post_init__(self):
        if self.kind not in KINDS:
            raise RequestError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise RequestError(f"structured output spec must be text, got {type(self.spec).__name__}")
        if self.spacing not in SPACINGS:
            raise RequestError(f"structured output spacing must be one of {tuple(SPACINGS)}, got {self.spacing!r}")

    @staticmethod
    def of(kind: str, value, after: int | None = None, spacing: str = "any") -> StructuredOutput:
        """From a request's value: a schema as a dict or JSON text, a list of choices, a regex or grammar text."""
        return dataclasses.replace(StructuredOutput._of(kind, value), after=after, spacing=spacing)

    @staticmethod
    def _of(kind: str, value) -> StructuredOutput:
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise RequestError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise RequestError(f"a JSON schema is an object, got {type(value).__name__}")
            return StructuredOutput("json", json.dumps(value, sort_keys=True))
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise RequestError("choice must be a non-empty list of strings")
            return StructuredOutput("choice", json.dumps(value))
        if kind == "json_object":
            return StructuredOutput("json_object")
        if not isinstance(value, str) or not value:
            raise RequestError(f"{kind} must be non-empty text")
        return StructuredOutput(kind, value)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `SamplingParams(structured_outputs=StructuredOutputsParams(json=...))` of the offline API: exactly one
    of json (a schema, dict or JSON text), regex, choice, grammar, json_object."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def kind_value(self) -> tuple[str, object]:
        """(kind, value) of the one form given (`StructuredOutput.of`'s); RequestError unless exactly one is."""
        given = [(k, getattr(self, k)) for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += [("json_object", None)] if self.json_object else []
        if len(given) != 1:
            raise RequestError(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                               f"got {[k for k, _ in given] or 'none'}")
        return given[0]

    def output(self) -> StructuredOutput:
        return StructuredOutput.of(*self.kind_value())


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (each literal: regex metacharacters escaped)."""
    special = set("\\^$.|?*+()[]{}/")
    return "(" + "|".join("".join("\\" + c if c in special else c for c in s) for s in choices) + ")"


class Grammars:
    """The compiler over one tokenizer and vocabulary (`vocab_size`: the model's logits width; ids past the
    tokenizer's are never allowed), the compiled specs, and each request's matcher."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, any_whitespace: bool = True):
        try:
            import xgrammar as xgr
        except ImportError:  # pragma: no cover - a dependency; an install without it says so
            raise ConfigError("structured outputs need the xgrammar package (pip install xgrammar)") from None
        self.xgr, self.vocab_size, self.any_whitespace = xgr, vocab_size, any_whitespace
        special = tokenizer.added_ids()
        vocab = [""] * min(tokenizer.vocab_size, vocab_size)
        for i, text in enumerate(tokenizer.vocab_strings(range(len(vocab)))):
            if i not in special:
                vocab[i] = text  # added / special tokens stay "": never grammar text
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.spec_json())
        stops = sorted(i for i in stop_ids if 0 <= i < vocab_size)
        info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stops,
                                 add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=False)
        # tokens holding a control character JSON never has raw (all but \n and \r): xgrammar (0.2.9) lets them into
        # length-limited strings (maxLength / minLength), which json.loads and pydantic refuse; JSON formats mask them
        texts = tokenizer.decode_each(range(len(vocab)))
        bad = [i for i, t in enumerate(texts) if any(ord(c) < 32 and c not in "\n\r" for c in t)]
        self.json_safe = torch.ones(vocab_size, dtype=torch.bool)
        self.json_safe[bad] = False
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # (bit shifts, json_safe)
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()
        self._batch = None  # xgrammar's BatchGrammarMatcher (its thread pool), made at the first wide step

    def _compile(self, so: StructuredOutput):
        c = self.compiler
        spacing = so.spacing if so.spacing != "any" or self.any_whitespace else "none"
        style = SPACINGS[spacing]
        if so.kind == "json":
            return c.compile_json_schema(so.spec, **style)
        if so.kind == "json_object":  # OpenAI's JSON mode: an object (not any JSON value)
            return c.compile_json_schema('{"type": "object"}', **style)
        if so.kind == "regex":
            return c.compile_regex(so.spec)
        if so.kind == "choice":
            return c.compile_regex(choice_regex(json.loads(so.spec)))
        return c.compile_grammar(so.spec)

    def compile(self, so: StructuredOutput):
        """`so` compiled (once: cached); RequestError naming the problem if it does not compile. Thread-safe: the
        server compiles a request's format off the engine thread before the engine adds it (`AsyncEngine.open`)."""
        so = dataclasses.replace(so, after=None)  # the grammar is the same wherever it starts
        with self._lock:
            compiled = self._compiled.get(so)
            if compiled is not None:
                self._compiled.move_to_end(so)
                return compiled
        try:
            compiled = self._compile(so)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())  # the C++ source location
            raise RequestError(f"invalid {so.kind} for structured output: {why}") from None
        with self._lock:
            self._compiled[so] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, so: StructuredOutput):
        """A fresh matcher of `so` (`compile`'s errors)."""
        return self.xgr.GrammarMatcher(self.compile(so))

    def allowed(self, matchers, device: torch.device, json_rows: list[int] | None = None) -> torch.Tensor:
        """bool [len(matchers), vocab_size] on `device`: the tokens each matcher allows next (`json_rows`: those of JSON
        formats, less the control-character tokens). On the host while the
        step's forward runs on a GPU; from BATCH_FILL_ROWS rows in xgrammar's worker threads
        (`benchmarks/structured_masks.py`, a 110k-token vocabulary, inside a JSON string, this 2-core machine:
        16 rows 3.5 -> 2.1 ms, 64 rows 9.9-10.0 -> 6.8-8.5 ms; 1 row 0.15-0.17 ms either way)."""
        bits = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) >= BATCH_FILL_ROWS:
            if self._batch is None:
                self._batch = self.xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(list(matchers), bits)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bits, i)
        words = bits.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else bits
        consts = self._on_device.get(device)
        if consts is None:  # made once a device, not every step
            consts = self._on_device[device] = (torch.arange(32, dtype=torch.int32, device=device),
                                                self.json_safe.to(device))
        shifts, safe = consts
        allowed = ((words[:, :, None] >> shifts) & 1).view(len(matchers), -1)[:, :self.vocab_size].bool()
        if json_rows:  # the rows of JSON formats: no raw control characters (see __init__)
            index = upload(json_rows, torch.long, device)
            allowed.index_copy_(0, index, allowed.index_select(0, index) & safe)
        return allowed


def mask_rows(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """A new tensor: `logits` with rows[i] at -inf where allowed[i] is False (contract 2: its input unwritten)."""
    index = upload(rows, torch.long, logits.device)
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))
