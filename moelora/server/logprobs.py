"""Logprobs in the response shapes: completions' legacy object, chat's `content` list, vLLM's
`prompt_logprobs`.

An engine entry is `(logprob, rank, ((id, logprob), ...))` (the top alternatives, most likely
first; the first prompt token's is `(None, None, ())`). A token's text is what it adds to the
response's text, so `text_offset` indexes `text`: a generated token decodes as the request's text
does (special tokens skipped by default), the EOS / stop token that ended a choice is "" (the text
leaves it out, unless include_stop_str_in_output), and an echoed prompt token keeps its special
tokens (the echoed text is the prompt as sent, with its <|im_start|>). With
`return_tokens_as_token_ids` every token reads "token_id:N" instead. Completions' `top_logprobs`
hold the sampled token besides the top `logprobs` (vLLM's: up to logprobs + 1 entries, the sampled
one first); chat's `top_logprobs` are the k most likely (OpenAI's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class TokenTexts:
    """Token id -> its text decoded alone, with special tokens skipped or kept; cached."""

    def __init__(self, decode):
        self._decode = decode
        self._cache: dict[tuple[int, bool], str] = {}

    def __call__(self, token_id: int, skip_special: bool) -> str:
        key = (token_id, skip_special)
        text = self._cache.get(key)
        if text is None:
            text = self._cache[key] = self._decode([token_id], skip_special_tokens=skip_special)
        return text


@dataclass(frozen=True)
class LogprobView:
    """How one request shows its tokens."""

    texts: TokenTexts
    skip_special: bool = True
    include_stop: bool = False
    as_ids: bool = False

    def name(self, token_id: int, prompt: bool = False) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.texts(token_id, self.skip_special and not prompt)

    def tokens(self, token_ids: Sequence[int], stop_last: bool = False, prompt: bool = False) -> list[str]:
        """Each token's text; `stop_last`: the last one is the EOS / stop token that ended the choice."""
        out = [self.name(t, prompt) for t in token_ids]
        if stop_last and out and not self.include_stop and not self.as_ids:
            out[-1] = ""
        return out

    def completion(self, token_ids: Sequence[int], entries: Sequence, offset: int, stop_last: bool = False,
                   prompt: bool = False) -> dict:
        """The legacy completions `logprobs` object; `offset`: where the first token's text starts."""
        tokens = self.tokens(token_ids, stop_last, prompt)
        offsets, top = [], []
        for tok, text, (lp, _, alternatives) in zip(token_ids, tokens, entries, strict=True):
            offsets.append(offset)
            offset += len(text)
            if lp is None:
                top.append(None)
                continue
            table = {text: lp}  # the sampled (or prompt) token first, as vLLM adds it
            for t, v in alternatives:
                table.setdefault(text if t == tok else self.name(t, prompt), v)
            top.append(table)
        return {"tokens": tokens, "token_logprobs": [e[0] for e in entries], "top_logprobs": top,
                "text_offset": offsets}

    def chat(self, token_ids: Sequence[int], entries: Sequence, stop_last: bool = False) -> list[dict]:
        """Chat's `logprobs.content` entries."""
        out = []
        for tok, text, (lp, _, alternatives) in zip(token_ids, self.tokens(token_ids, stop_last), entries,
                                                    strict=True):
            top = [(text if t == tok else self.name(t), v) for t, v in alternatives]
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in top]})
        return out

    def prompt_logprobs(self, token_ids: Sequence[int], entries: Sequence, k: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank, decoded_token}}
        of the prompt token and the k most likely there."""
        out: list[dict | None] = []
        for tok, (lp, rank, alternatives) in zip(token_ids, entries, strict=True):
            if lp is None:
                out.append(None)
                continue
            table = {str(tok): {"logprob": lp, "rank": rank, "decoded_token": self.name(tok, prompt=True)}}
            for j, (t, v) in enumerate(alternatives[:k]):
                table.setdefault(str(t), {"logprob": v, "rank": j + 1, "decoded_token": self.name(t, prompt=True)})
            out.append(table)
        return out
