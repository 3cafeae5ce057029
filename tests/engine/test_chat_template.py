"""The chat template sandbox renders as transformers' `apply_chat_template` does: its `{% generation %}` blocks,
`strftime_now`, `namespace` (no underscore-prefixed attributes) and `tojson` arguments, on the same messages."""

from __future__ import annotations

import pytest

from moelora.demo import model_dir
from moelora.engine.tokenizer import Tokenizer
from moelora.errors import RequestError

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

TEMPLATE = (
    "{%- set ns = namespace(turns=0) -%}"
    "{{ '[' + strftime_now('%Y') + ']' }}"
    "{% for m in messages %}{% set ns.turns = ns.turns + 1 %}"
    "{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}{% endgeneration %}</a>"
    "{% else %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endif %}{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=2, ensure_ascii=False) }}{% endif %}"
    "{{ ns.turns }}{% if add_generation_prompt %}<a>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "again"}]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "é & <x>", "parameters": {}}}]


def test_template_renders_as_transformers_renders_it():
    ours = Tokenizer(model_dir(), chat_template=TEMPLATE).apply_chat_template(MESSAGES, tools=TOOLS)
    theirs = chat_template_utils._compile_jinja_template(TEMPLATE).render(
        messages=MESSAGES, tools=TOOLS, add_generation_prompt=True, bos_token="", eos_token="")
    assert ours == theirs and "<a>hi</a>" in ours and "é & <x>" in ours and ours.endswith("3<a>")


def test_a_namespace_refuses_underscore_attributes():
    tok = Tokenizer(model_dir(), chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(Exception, match="underscore"):
        tok.apply_chat_template(MESSAGES)
    tok = Tokenizer(model_dir(), chat_template="{% set ns = namespace() %}{% set ns._y = 2 %}")
    with pytest.raises(Exception, match="underscore"):
        tok.apply_chat_template(MESSAGES)


def test_a_template_error_is_a_request_error():
    with pytest.raises(RequestError, match="chat template failed"):
        Tokenizer(model_dir(), chat_template="{% generation %}unclosed").apply_chat_template(MESSAGES)
