"""Prompts and tokens: chat messages rendered to a prompt (vLLM's template fields), and the tokenizer
routes POST /tokenize, POST /detokenize, GET /tokenizer_info.

`continue_final_message` leaves the last message open: the prompt ends right after its content (the
template's end-of-turn cut off), so the model continues it; it needs add_generation_prompt false.
"""

from __future__ import annotations

from collections.abc import Sequence

from moelora.engine.tokenizer import Tokenizer
from moelora.errors import RequestError
from moelora.server.protocol import ApiError, ChatMessage, DetokenizeRequest, TokenizeRequest, template_tools

_MARK = "\x00moelora-final-message\x00"  # stands for the final message's content while rendering


def render_chat(tokenizer: Tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool | None,
                continue_final_message: bool | None = False, template_kwargs: dict | None = None,
                tools: list[dict] | None = None, content_format: str = "string") -> str:
    """The prompt text the chat template makes of `messages` and `tools` (400 on a template error);
    `content_format` "openai": each message's content as a list of text parts (vLLM's
    --chat-template-content-format), "string": as one string."""
    add_generation_prompt = add_generation_prompt is not False
    if continue_final_message and add_generation_prompt:
        raise ApiError(400, "continue_final_message needs add_generation_prompt to be false",
                       "continue_final_message")
    turns = [m.turn() for m in messages]
    final = turns[-1]["content"] if turns else ""
    if continue_final_message:
        turns[-1] = {**turns[-1], "content": _MARK}
    if content_format == "openai":
        turns = [{**t, "content": [{"type": "text", "text": t["content"]}] if t["content"] else []} for t in turns]
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **(template_kwargs or {}))
    except RequestError as e:
        raise ApiError(400, str(e), "messages") from None
    if continue_final_message:
        at = text.rfind(_MARK)
        if at < 0:
            raise ApiError(400, "continue_final_message: the chat template does not render the final message's "
                           "content", "continue_final_message")
        text = text[:at] + final
    return text


def template_kwargs(defaults: dict | None, requested: dict | None, reasoning_effort: str | None = None) -> dict:
    """A chat's template variables: --default-chat-template-kwargs, over them what the request's `reasoning_effort`
    sets (vLLM's rule: the variable itself, and enable_thinking false for "none", true for any other effort), over
    both the request's chat_template_kwargs."""
    effort = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort,
                                                  "enable_thinking": reasoning_effort != "none"}
    return {**(defaults or {}), **effort, **(requested or {})}


class TokenRoutes:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, resolve_model, model_path: str,
                 content_format: str = "string", default_template_kwargs: dict | None = None):
        self.tokenizer, self.max_model_len, self.resolve_model = tokenizer, max_model_len, resolve_model
        self.model_path, self.content_format = model_path, content_format
        self.default_template_kwargs = default_template_kwargs

    def tokenize(self, body: TokenizeRequest) -> dict:
        """The ids completions / chat would feed the model for this prompt or these messages."""
        if body.model is not None:
            self.resolve_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is None:
            text, special = body.prompt, body.add_special_tokens is not False
        else:
            text = render_chat(self.tokenizer, body.messages, body.add_generation_prompt,
                               body.continue_final_message,
                               template_kwargs(self.default_template_kwargs, body.chat_template_kwargs),
                               template_tools(body.tools), self.content_format)
            special = bool(body.add_special_tokens)
        ids = self.tokenizer.encode(text, add_special_tokens=special)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = self.tokenizer.vocab_strings(ids)  # vLLM's: the vocabulary's strings
        return out

    def detokenize(self, body: DetokenizeRequest) -> dict:
        if body.model is not None:
            self.resolve_model(body.model)
        vocab = self.tokenizer.vocab_size
        outside = [t for t in body.tokens if t >= vocab]
        if outside:
            raise ApiError(400, f"token ids outside the vocabulary (size {vocab}): {outside[:5]}", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def tokenizer_info(self) -> dict:
        """vLLM's GET /tokenizer_info: the tokenizer's configuration (tokenizer_config.json's fields), its
        class, and the chat template in use."""
        tok = self.tokenizer
        # special tokens as their text (tokenizer_config.json may hold {"content": ...} objects)
        info = {k: v["content"] if k.endswith("_token") and isinstance(v, dict) and "content" in v else v
                for k, v in tok.config.items() if k != "chat_template"}
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        info.setdefault("name_or_path", self.model_path)
        info["vocab_size"] = tok.vocab_size
        info["eos_token_id"] = tok.eos_token_id
        info["chat_template"] = tok.chat_template
        return info
