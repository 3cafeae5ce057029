"""Fixtures of the server tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def scripted_replies(monkeypatch):
    """Each choice's generated text becomes the next reply of the list given (in pieces of 7 characters, one
    an engine event, the rest with the finishing event); the request needs max_tokens >= the pieces. The
    engine still runs the request: its token counts, finish and metrics stand."""
    from moelora.server.serving import OpenAIServing

    replies, real_run = [], OpenAIServing._run

    async def run(self, stream, body, label, arrival):
        pieces = {}
        async for ev in real_run(self, stream, body, label, arrival):
            if ev.index not in pieces:
                text = replies.pop(0)
                pieces[ev.index] = [text[i:i + 7] for i in range(0, len(text), 7)]
            left = pieces[ev.index]
            ev.text = "".join(left) if ev.finish_reason is not None else (left.pop(0) if left else "")
            if ev.finish_reason is not None:
                left.clear()
            yield ev

    monkeypatch.setattr(OpenAIServing, "_run", run)
    return replies
