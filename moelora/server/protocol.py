"""Request bodies of the OpenAI-compatible API (pydantic) and the error every failure becomes.

Bodies are strict: an unknown field is refused (400, naming it) rather than ignored, so a client
never believes a setting took effect when it did not. Fields of OpenAI's or vLLM's API that this
server does not implement are listed in the class's `accepted_at` with the values at which they
change nothing (null, their default, their "off"): such a value is accepted, logged at debug and
dropped; any other value is refused (400, naming the field), as it would change the result and
cannot be honoured. Types are strict too (no "5" for 5), except that an integer is accepted where
a float is expected.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moelora.engine.structured import StructuredOutputsParams as EngineStructuredOutputs
from moelora.errors import RequestError

log = logging.getLogger("moelora.server")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 409: "ConflictError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class ApiError(Exception):
    """An HTTP error in OpenAI's body shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


ANY = object()  # in `accepted_at`: every value changes nothing (advisory fields: store, metadata, ...)
NONE = (None,)
NONE_OR_EMPTY = (None, [])


def _same(value, neutral) -> bool:
    """`value` is `neutral` in JSON terms: True is not 1, but 1 is 1.0."""
    if neutral is ANY:
        return True
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    numbers = type(value) in (int, float) and type(neutral) in (int, float)
    return (numbers or type(value) is type(neutral)) and value == neutral


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # field -> the values at which it changes nothing: accepted (logged at debug) and dropped; others: 400
    accepted_at: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral_fields(cls, data):
        if not isinstance(data, dict) or not cls.accepted_at.keys() & data.keys():
            return data
        data = dict(data)
        for name in cls.accepted_at.keys() & data.keys():
            value = data.pop(name)
            if not any(_same(value, n) for n in cls.accepted_at[name]):
                shown = ", ".join(repr(n) for n in cls.accepted_at[name])
                raise ApiError(400, f"'{name}' is not implemented by this server (got {value!r}; accepted: "
                               f"{shown})", name)
            log.debug("%s: field %r at %r accepted (changes nothing)", cls.__name__, name, value)
        return data


NonNegFloat = Annotated[float, Field(ge=0)]
NonNegInt = Annotated[int, Field(ge=0)]
StopField = str | list[str] | None

# vLLM's and OpenAI's sampling fields this server does not implement, at the values that leave them off
_SAMPLING_OFF = {
    "use_beam_search": (False,), "length_penalty": (1,), "early_stopping": (False,), "best_of": (None, 1),
    "guided_whitespace_pattern": NONE,
    # vLLM picks a structured-output backend with it; xgrammar (vLLM's default) is the one here
    "guided_decoding_backend": (ANY,),
    "kv_transfer_params": NONE,
    "vllm_xargs": NONE, "logits_processors": NONE,
    "mm_processor_kwargs": NONE, "media_io_kwargs": NONE,
    "service_tier": (ANY,), "store": (ANY,), "metadata": (ANY,), "prompt_cache_key": (ANY,),
    "safety_identifier": (ANY,),
}


class StreamOptions(_Body):
    # OpenAI's: random padding on each chunk against length side channels; the chunks' content is the same
    accepted_at = {"include_obfuscation": (ANY,)}

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk (with include_usage)


class JsonSchemaFormat(_Body):
    name: str | None = None  # OpenAI requires it; vLLM does not
    description: str | None = None
    # the schema (OpenAI's key `schema`; pydantic keeps the name off BaseModel's own attribute)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(_Body):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object), "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ApiError(400, "response_format of type json_schema needs json_schema.schema", "response_format")
        return self


class StructuredOutputsParams(_Body):
    """vLLM's `structured_outputs`: exactly one of json / regex / choice / grammar / json_object."""

    # disable_additional_properties: guidance's in vLLM (xgrammar reads the schema's own)
    accepted_at = {"disable_fallback": (ANY,), "disable_additional_properties": (ANY,), "whitespace_pattern": NONE,
                   "structural_tag": NONE}

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # (BaseModel has a `json` method)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # compact JSON

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class _Sampling(_Body):
    """Fields shared by completions and chat completions (vLLM extensions marked)."""

    model: str | None = None  # None: the base model
    temperature: NonNegFloat | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM: -1 or 0 is off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None  # vLLM: 0 is off
    seed: int | None = None
    stop: StopField = None
    stop_token_ids: list[int] | None = None  # vLLM
    ignore_eos: bool | None = False  # vLLM
    n: Annotated[int, Field(ge=1, le=16)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's is advisory
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None  # vLLM: 1 is off
    min_tokens: NonNegInt | None = 0  # vLLM
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    prompt_logprobs: NonNegInt | None = None  # vLLM
    skip_special_tokens: bool | None = True  # vLLM
    spaces_between_special_tokens: bool | None = True  # vLLM
    include_stop_str_in_output: bool | None = False  # vLLM
    return_tokens_as_token_ids: bool | None = None  # vLLM: None takes the server's setting
    return_token_ids: bool | None = False  # vLLM: token ids of the prompt and of each choice
    request_id: str | None = None  # vLLM: the response's id
    # vLLM: keep only the last k prompt tokens (-1: the last max_model_len)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM: its own prefix-cache namespace
    priority: int | None = 0  # vLLM: lower first, with --scheduling-policy priority (0 otherwise)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM: only these are generated
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None  # vLLM: never generated
    # structured outputs (engine/structured.py): OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields; at most one of them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> tuple[str, Any] | None:
        """(kind, value) of the one structured output the request asks (`StructuredOutput.of`'s), or None."""
        asked = []
        f = self.response_format
        if f is not None and f.type == "json_object":
            asked.append(("response_format", ("json_object", None)))
        elif f is not None and f.type == "json_schema":
            asked.append(("response_format", ("json", f.json_schema.json_schema)))
        so = self.structured_outputs
        if so is not None:
            form = EngineStructuredOutputs(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=so.json_object)
            try:
                asked.append(("structured_outputs", form.kind_value()))
            except RequestError as e:
                raise ApiError(400, str(e), "structured_outputs") from None
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, (kind, getattr(self, name))))
        if len(asked) > 1:
            raise ApiError(400, f"more than one structured output asked ({', '.join(n for n, _ in asked)}): give "
                           "one", asked[1][0])
        return asked[0][1] if asked else None

    def json_spacing(self) -> str:
        """vLLM's structured_outputs.disable_any_whitespace: "none" (no whitespace between a JSON format's tokens),
        else "any" (`StructuredOutput.spacing`)."""
        compact = self.structured_outputs is not None and self.structured_outputs.disable_any_whitespace
        return "none" if compact else "any"

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    def usage_mode(self) -> tuple[bool, bool]:
        """(usage in a last chunk, usage on every chunk) of a stream."""
        o = self.stream_options
        final = o is not None and bool(o.include_usage)
        return final, final and bool(o.continuous_usage_stats)


class CompletionRequest(_Sampling):
    accepted_at = {**_SAMPLING_OFF, "suffix": (None, ""), "prompt_embeds": NONE}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: NonNegInt | None = 16  # 0 only with echo (prompt logprobs alone)
    # chat's newer name, which load generators (guidellm) send here beside max_tokens: max_tokens' value
    max_completion_tokens: NonNegInt | None = None
    logprobs: NonNegInt | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True  # vLLM: what tokenizer.json adds around a prompt (e.g. BOS)

    @model_validator(mode="after")
    def _max_completion_tokens_is_max_tokens(self):
        if self.max_completion_tokens is not None:
            if "max_tokens" in self.model_fields_set and self.max_tokens != self.max_completion_tokens:
                raise ApiError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                               f"({self.max_completion_tokens}) differ: give one, or the same value",
                               "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI's responses carry it


class ToolCallMessage(_Body):
    """An earlier assistant turn's call, as a client sends the history back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def turn(self) -> dict:
        """The call as chat templates read it (transformers' convention): arguments as an object."""
        try:
            args = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            raise ApiError(400, f"tool call {self.id!r}: arguments are not a JSON object", "messages")
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class ChatMessage(_Body):
    # what `message.model_dump()` of an openai client's response re-sends, at null
    accepted_at = {"refusal": NONE, "audio": NONE, "function_call": NONE, "annotations": NONE_OR_EMPTY}

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's
    # an assistant's reasoning, as a response with --reasoning-parser carries it (under both names)
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def turn(self) -> dict:
        """The message as the chat template reads it."""
        out = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [c.turn() for c in self.tool_calls]
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning  # the name templates read (Qwen3's)
        return out

    @model_validator(mode="after")
    def _tool_calls_are_the_assistants(self):
        if self.tool_calls and self.role != "assistant":
            raise ApiError(400, f"tool_calls in a {self.role!r} message: only an assistant's may carry them",
                           "messages")
        return self


class FunctionDefinition(_Body):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition

    def template(self) -> dict:
        """The tool as chat templates read it: the request's JSON, unset fields left out."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


def template_tools(tools: list[ChatTool] | None) -> list[dict] | None:
    """A request's tools as chat templates read them (None: none)."""
    return [t.template() for t in tools] if tools else None


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class _ChatTemplateFields(_Body):
    """How messages become a prompt (vLLM's fields; /tokenize shares them)."""

    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False  # the last message stays open (add_generation_prompt false)
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    add_special_tokens: bool | None = False  # the template writes its own


_CHAT_OFF = {**_SAMPLING_OFF, "functions": NONE_OR_EMPTY, "function_call": (None, "none", "auto"),
             "modalities": (None, ["text"]),
             "prediction": NONE, "web_search_options": NONE, "audio": NONE, "documents": NONE,
             "chat_template": NONE, "verbosity": NONE}


class ChatCompletionRequest(_ChatTemplateFields, _Sampling):
    accepted_at = _CHAT_OFF

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: NonNegInt | None = None
    echo: bool | None = False  # vLLM: the reply starts with the last message's content if it is the assistant's
    tools: list[ChatTool] | None = None
    # None: "auto" with tools, else "none"; "required" and a named function: structured outputs (forced_tools.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True  # false: at most the first call of a reply is returned
    include_reasoning: bool | None = True  # vLLM: false leaves the reasoning (--reasoning-parser) out
    # vLLM's: a template variable of that name, and enable_thinking false for "none", true otherwise (Qwen3's and
    # GLM's templates read it); the request's chat_template_kwargs win (`tokens.template_kwargs`)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def tool_mode(self) -> str:
        """"none", "auto" (what the tools and tool_choice ask), "required" or "named"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else "named"


class TokenizeRequest(_ChatTemplateFields):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the chat template first.
    `add_special_tokens` defaults to true for a prompt and false for messages, as there."""

    accepted_at = {"chat_template": NONE, "mm_processor_kwargs": NONE}

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class LoadLoRAAdapterRequest(_Body):
    accepted_at = {"load_inplace": (False,)}  # vLLM's: replacing a loaded adapter in place is not supported

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRAAdapterRequest(_Body):
    accepted_at = {"lora_int_id": (ANY,)}  # vLLM's schema has it; the adapter is the one lora_name names

    lora_name: Annotated[str, Field(min_length=1)]
