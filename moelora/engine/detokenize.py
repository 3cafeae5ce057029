"""Incremental detokenisation: token ids in, text out, at a cost per token that does not grow with
the output.

`IncrementalDetokenizer` streams text deltas; the server runs it on its event loop, never in the
engine thread. `StopStrings` is the engine's stop-string check, built on it: once per token, so
it must not decode the whole output each time (a 2000-token output costs ~0.4 ms a decode on a CPU
core, per request and step: over the device's step time at a few dozen such requests).

Each push decodes only a short window (the last settled tokens plus the new ones) and takes
the text that the new tokens add in that context, so the cost per token does not grow with the
output. Text is held back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD), and,
when stop strings are set, by their longest length minus one, so nothing is ever sent that the
engine later cuts off at a stop string. `finish` reconciles with the engine's final text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


def find_stop(text: str, stop: Sequence[str], floor: int = 0, since: int = 0) -> int:
    """Where the first stop string in `text` starts, among those that end after `floor` and past
    `since` (text up to there was searched before); -1 if none."""
    return first_stop(text, stop, floor, since)[0]


def first_stop(text: str, stop: Sequence[str], floor: int = 0, since: int = 0) -> tuple[int, str | None]:
    """`find_stop` and the stop string found there ((-1, None) if none; the earlier in `stop` on a tie)."""
    hits = [(text.find(s, max(0, floor - len(s) + 1, since - len(s) + 1)), s) for s in stop]
    return min(((i, s) for i, s in hits if i >= 0), key=lambda h: h[0], default=(-1, None))


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

    @property
    def num_ids(self) -> int:
        """Tokens pushed so far."""
        return len(self._ids)

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


class StopStrings:
    """A request's stop strings, checked as its tokens arrive. `found(output_ids)` pushes the tokens
    added since the last call and searches only the text they settled (plus each string's length
    back), for a string ending after `floor` (the text length of the first min_tokens outputs). A
    hit is a trigger: the engine then cuts the whole output's decode, once, so the text it returns
    is the whole decode's whatever the window decodes (the same for byte-level BPE and
    SentencePiece)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str], floor: int = 0):
        self._detok = IncrementalDetokenizer(decode)
        self.stop, self.floor = tuple(stop), floor
        self._searched = 0  # settled text searched so far

    def found(self, output_ids: Sequence[int]) -> bool:
        self._detok.push(output_ids[self._detok.num_ids:])
        text = self._detok.settled
        hit = find_stop(text, self.stop, self.floor, self._searched) >= 0
        self._searched = len(text)
        return hit
