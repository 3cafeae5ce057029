"""Request-level value objects: `SamplingParams` (validated) and `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from moelora.engine.structured import StructuredOutput, StructuredOutputsParams
from moelora.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request. temperature 0 is greedy; top_k <= 0 and top_p 1 are off.
    Penalties (OpenAI / vLLM semantics, off at their defaults): repetition_penalty divides the
    positive logits and multiplies the negative ones of every token in the prompt or the output so
    far; then frequency_penalty x (times the token was generated) and presence_penalty x (it was
    generated at all) are subtracted. logit_bias (OpenAI): token id -> bias in [-100, 100] added to
    its logit; min_tokens (vLLM): no EOS, stop token or stop string ends the request before it has
    generated that many tokens. min_p (vLLM): after temperature, tokens whose probability is below
    min_p x the most likely token's are dropped (0 is off). allowed_token_ids (vLLM): no other token is generated
    (EOS included: leave it out and the request runs to max_tokens). bad_words (vLLM): the engine tokenizes each at
    the text's start and after a space into bad_words_ids (token ids may be given there too): a word's last token
    is never generated right after its other tokens (a one-token word: never).

    Output (vLLM's): the EOS or stop token that ends a request is a generated token: it is in
    `output_ids` (and `logprobs`) and counts towards max_tokens, but not in the text unless
    `include_stop_str_in_output`, which also keeps a matched stop string at the end of the text.
    `skip_special_tokens` (default) leaves special tokens out of the text;
    `spaces_between_special_tokens` False is refused unless they are skipped (a fast tokenizer's
    decode never inserts such spaces)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # per token: the sampled token's logprob and the top `logprobs` (0: none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # a {token id: bias} mapping is accepted too
    min_tokens: int = 0
    min_p: float = 0.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # the output held to a schema, regex, choice or grammar
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM: only these may be generated
    bad_words: tuple[str, ...] = ()  # vLLM: never generated (the engine tokenizes them into bad_words_ids)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # bad words as token ids: never generated in full
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's offline form of `structured`

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if hasattr(self.logit_bias, "items") else self.logit_bias
        try:
            bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        object.__setattr__(self, "logit_bias", bias)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            raise RequestError(f"top_k must be an integer, got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise RequestError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (self.spaces_between_special_tokens or self.skip_special_tokens):
            raise RequestError("spaces_between_special_tokens=False is not supported with skip_special_tokens=False "
                               "(a fast tokenizer's decode never inserts spaces between special tokens)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not self.repetition_penalty > 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        bad = next(((t, b) for t, b in self.logit_bias if t < 0 or not -100 <= b <= 100), None)
        if bad is not None:
            raise RequestError(f"logit_bias entries must be a token id >= 0 and a bias in [-100, 100], got {bad}")
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise RequestError(f"bad_words must be non-empty strings, got {list(self.bad_words)}")
        if self.structured_outputs is not None:
            if self.structured is not None:
                raise RequestError("give structured or structured_outputs, not both")
            object.__setattr__(self, "structured", self.structured_outputs.output())
            object.__setattr__(self, "structured_outputs", None)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
            if not self.allowed_token_ids or min(self.allowed_token_ids) < 0:
                raise RequestError(f"allowed_token_ids must be a non-empty list of token ids >= 0, got "
                                   f"{list(self.allowed_token_ids)}")
        object.__setattr__(self, "bad_words_ids", tuple(tuple(int(t) for t in w) for w in self.bad_words_ids))
        if any(not w or min(w) < 0 for w in self.bad_words_ids):
            raise RequestError("bad words must be non-empty token id sequences")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                               f"got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling must see other logits than the model's (penalties, bias, min_tokens)."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.structured is not None
                or self.allowed_token_ids is not None or bool(self.bad_words_ids))

    @property
    def reads_its_output(self) -> bool:
        """Whether sampling a token needs the request's earlier output tokens on the host (a grammar, a bad word of
        several tokens): an overlapped step holding one samples after the previous step is read back."""
        return self.structured is not None or any(len(w) > 1 for w in self.bad_words_ids)


@dataclass
class RequestOutput:
    """One request's result, as vLLM's: `token_ids` holds the EOS / stop token that ended it (its text
    does not, unless include_stop_str_in_output)."""

    prompt: str | None
    prompt_token_ids: list[int]
    adapter: str | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (eos, stop string or stop id) or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched (None: EOS, length)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape of the same result (`out.outputs[0].text`): one sample a RequestOutput here."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason)]


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's per-sample view of a RequestOutput (`RequestOutput.outputs`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None


class Status:
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


PENDING = -1  # token id placeholder of a token sampled on the device and not read back yet


@dataclass(eq=False)
class Request:
    """One sequence in the engine. `num_computed` tokens of `all_ids` have their KV in cache."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    prompt: str | None = None
    # time.monotonic() stamps, host-side (for the metrics): added (queued), first scheduled, first token read
    # back, finished (None: not yet)
    arrival: float = 0.0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied when it was (last) admitted
    output_ids: list[int] = field(default_factory=list)
    status: str = Status.WAITING
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    block_hashes: list = field(default_factory=list)  # chain hash of each of those blocks, in order
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's)
    text: str = ""
    num_preemptions: int = 0
    generator: object = None
    cache_key: object = None  # the adapter's prefix-cache identity (None: base model), with a cache_salt: a pair
    logprobs: list = field(default_factory=list)  # per output token (the stop token too), when params.logprobs
    # is set: (logprob, rank, ((id, logprob), ...)), see sampler
    # Overlapped scheduling: tokens sampled on the device but not read back yet. They count in
    # num_tokens (the next step computes them) and read as PENDING in token_slice; output_ids holds
    # read tokens only.
    num_pending: int = 0
    penalty: object = None  # sampler.PenaltyState on the device, for requests with penalties
    stop_strings: object = None  # detokenize.StopStrings, from the first check of the request's stop strings
    matcher: object = None  # structured outputs: the request's grammar matcher (engine/structured.py)
    grammar_on: bool = False  # the matcher holds the output now (from the start, or since the `after` token)
    coming_hashes: tuple | None = None  # the scheduler's: prefix hashes of the prompt blocks it computes
    priority: int = 0  # vLLM's: lower is scheduled first under the "priority" policy (scheduler.py)

    @property
    def all_ids(self) -> list[int]:
        """The known token ids (prompt + read outputs); pending tokens are not included."""
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """Token ids [start, start + n) without building all_ids (a decode step reads one token);
        a position whose token is still pending reads PENDING."""
        p, known = len(self.prompt_ids), len(self.prompt_ids) + len(self.output_ids)
        pending = [PENDING] * max(0, start + n - max(start, known))
        n -= len(pending)
        if start >= p:
            return self.output_ids[start - p:start - p + n] + pending
        if start + n <= p:
            return self.prompt_ids[start:start + n] + pending
        return self.prompt_ids[start:] + self.output_ids[:start + n - p] + pending

    def token_at(self, i: int) -> int:
        """Token id at position i (`token_slice(i, 1)[0]` without the lists): PENDING if not read yet."""
        p = len(self.prompt_ids)
        if i < p:
            return self.prompt_ids[i]
        i -= p
        return self.output_ids[i] if i < len(self.output_ids) else PENDING

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED
