"""Request bodies of the OpenAI-compatible API (pydantic) and the error every failure becomes.

Bodies are strict: an unknown field is refused (400, naming it) rather than ignored, so a
client never believes a setting took effect when it did not. OpenAI fields this server does
not implement are declared and listed in the class's `unimplemented` with the values that mean
"off"; any other value is refused by `check_implemented` (400, naming the field). Types are
strict too (no "5" for 5), except that an integer is accepted where a float is expected.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

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


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # field -> the values that leave it off; any other value is refused by `check_implemented`
    unimplemented: ClassVar[dict[str, tuple]] = {}

    def check_implemented(self) -> None:
        for name, neutral in self.unimplemented.items():
            value = getattr(self, name)
            if value not in neutral:
                raise ApiError(400, f"'{name}' is not implemented by this server (got {value!r})", name)


NonNegFloat = Annotated[float, Field(ge=0)]
StopField = str | list[str] | None


class StreamOptions(_Body):
    include_usage: bool | None = False


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str
    temperature: NonNegFloat | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM extension: -1 or 0 is off
    seed: int | None = None
    stop: StopField = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's is advisory
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None  # vLLM extension: 1 is off
    min_tokens: Annotated[int, Field(ge=0)] = 0  # vLLM extension
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    unimplemented = {"suffix": (None, ""), "best_of": (None, 1)}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # 0 only with echo (prompt logprobs alone)
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    unimplemented = {"tools": (None, []), "tool_choice": (None, "none"),
                     "functions": (None, []), "function_call": (None, "none"),
                     "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,)}

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True  # vLLM extension
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the chat template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class LoadLoRAAdapterRequest(_Body):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRAAdapterRequest(_Body):
    lora_name: Annotated[str, Field(min_length=1)]
