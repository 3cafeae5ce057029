"""Incremental detokenisation for streaming: token ids in, text deltas out.

Runs on the server's event loop, never in the engine thread, so decoding costs no step time.
Each push decodes only a short window (the last settled tokens plus the new ones) and takes
the text that the new tokens add in that context, so the cost per token does not grow with the
output. Text is held back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD), and,
when stop strings are set, by their longest length minus one, so nothing is ever sent that the
engine later cuts off at a stop string. `finish` reconciles with the engine's final text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are settled and never decoded again
        self._read = 0  # tokens up to here are settled
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.settled = ""  # text of ids[:read]
        self.emitted = ""  # what `push` / `finish` have returned, concatenated

    def push(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new text that is safe to send now (possibly "")."""
        self._ids.extend(token_ids)
        window = self._decode(self._ids[self._prefix:])
        if len(window) > len(self._prefix_text) and not window.endswith(REPLACEMENT):
            self.settled += window[len(self._prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        end = max(len(self.emitted), len(self.settled) - self._holdback)
        delta = self.settled[len(self.emitted):end]
        self.emitted += delta
        return delta

    def finish(self, final_text: str | None) -> str:
        """The rest of the text once the request is done: `final_text` is the engine's whole text
        (cut at a stop string; the last tokens need not have been pushed), or None to flush."""
        if final_text is None:
            window = self._decode(self._ids[self._prefix:])
            final_text = self.settled + window[len(self._prefix_text):]
        if not final_text.startswith(self.emitted):  # cannot happen for byte-level or SentencePiece
            return ""
        delta = final_text[len(self.emitted):]
        self.emitted = final_text
        return delta
