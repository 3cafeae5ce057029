"""vLLM's request fields and output rules through the real server (uvicorn + the `openai` client /
httpx): each implemented field changes the result as documented, each unimplemented one is accepted
at its off value (400 naming it otherwise), the sampled EOS / stop token is counted and has a
logprob entry, and text_offset indexes text.

The model is test_server.py's tiny Qwen3-MoE with its byte-level tokenizer, plus a BOS post-processor
(so add_special_tokens shows) and a chat template that reads `enable_thinking` and `reasoning_effort`
(chat_template_kwargs, reasoning_effort).
One server per module, with /tokenizer_info on and max_logprobs 5.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.server import BASE, TIMEOUT, byte_tokenizer, cpu_app, make_client, post, serving, write_model

openai = pytest.importorskip("openai")

BOS, IM_START, EOS = 256, 257, 258  # <|endoftext|>, <|im_start|>, <|im_end|> (the eos token)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")
MAX_LOGPROBS = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import processors

    out, _ = write_model(tmp_path_factory.mktemp("server_fields"))
    tok = byte_tokenizer()
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[
        ("<|endoftext|>", BOS)])
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def url(model_dir):
    with serving(cpu_app(model_dir, enable_tokenizer_info_endpoint=True, max_logprobs=MAX_LOGPROBS)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return make_client(url)


def completion(url, **body) -> dict:
    r = post(url, "/v1/completions", {"model": BASE, "temperature": 0, "max_tokens": 6, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(url, messages, **body) -> dict:
    r = post(url, "/v1/chat/completions", {"model": BASE, "temperature": 0, "max_tokens": 6, "messages": messages,
                                           **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse_chunks(url, path, body) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


USER = [{"role": "user", "content": "hi there"}]
END_ON_EOS = {"logit_bias": {str(EOS): 100}, "min_tokens": 2}  # EOS is the third token


# ------------------------------------------------------------------------- EOS, usage, stop_reason


def test_the_sampled_eos_is_a_generated_token_with_a_logprob_entry(url):
    c = completion(url, prompt="abc", logprobs=1, **END_ON_EOS)
    choice, lp = c["choices"][0], c["choices"][0]["logprobs"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert c["usage"]["completion_tokens"] == 3 == len(lp["tokens"]) == len(lp["token_logprobs"])
    # the model's own logprob (logit_bias shapes the draw, not the reported distribution)
    assert lp["tokens"][-1] == "" and lp["top_logprobs"][-1][""] == lp["token_logprobs"][-1] < 0
    assert choice["text"] == "".join(lp["tokens"]) and lp["text_offset"] == [0, len(lp["tokens"][0]),
                                                                               len("".join(lp["tokens"][:2]))]
    ids = completion(url, prompt="abc", return_token_ids=True, **END_ON_EOS)["choices"][0]
    assert ids["token_ids"][-1] == EOS and len(ids["token_ids"]) == 3 and ids["prompt_token_ids"][0] == BOS
    chunks = sse_chunks(url, "/v1/completions", {"model": BASE, "prompt": "abc", "temperature": 0, "max_tokens": 6,
                                                 "stream_options": {"include_usage": True}, **END_ON_EOS})
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == choice["text"]
    m = chat(url, USER, logprobs=True, top_logprobs=2, **END_ON_EOS)
    content = m["choices"][0]["logprobs"]["content"]
    assert m["usage"]["completion_tokens"] == 3 == len(content) and content[-1]["token"] == ""
    assert m["choices"][0]["stop_reason"] is None and m["choices"][0]["message"]["content"] == content[0]["token"] + \
        content[1]["token"]


def test_stop_reason_names_the_stop_token_or_string(url):
    free = completion(url, prompt="stop here", max_tokens=8, ignore_eos=True, return_token_ids=True)["choices"][0]
    tok = free["token_ids"][3]
    by_id = completion(url, prompt="stop here", max_tokens=8, stop_token_ids=[tok], return_token_ids=True)
    first = free["token_ids"].index(tok)
    assert by_id["choices"][0]["token_ids"] == free["token_ids"][:first + 1]
    assert (by_id["choices"][0]["finish_reason"], by_id["choices"][0]["stop_reason"]) == ("stop", tok)
    assert by_id["usage"]["completion_tokens"] == first + 1
    text = free["text"]
    word = next(text[i:i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    cut = completion(url, prompt="stop here", max_tokens=8, ignore_eos=True, stop=[word])["choices"][0]
    assert (cut["text"], cut["stop_reason"]) == (text[:text.index(word)], word)
    kept = completion(url, prompt="stop here", max_tokens=8, ignore_eos=True, stop=[word],
                      include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == text[:text.index(word) + len(word)]
    assert free["stop_reason"] is None and free["finish_reason"] == "length"
    m = chat(url, USER, max_tokens=8, ignore_eos=True, stop=[word])["choices"][0]
    assert m["finish_reason"] != "stop" or m["stop_reason"] == word


def test_include_stop_str_in_output_keeps_a_stop_token_text(url):
    free = completion(url, prompt="xyz", max_tokens=8, ignore_eos=True, return_token_ids=True)["choices"][0]
    tok = free["token_ids"][1]
    plain = completion(url, prompt="xyz", max_tokens=8, stop_token_ids=[tok], logprobs=0)["choices"][0]
    kept = completion(url, prompt="xyz", max_tokens=8, stop_token_ids=[tok], logprobs=0,
                      include_stop_str_in_output=True)["choices"][0]
    assert plain["logprobs"]["tokens"][-1] == "" and kept["logprobs"]["tokens"][-1] != ""
    assert kept["text"] == plain["text"] + kept["logprobs"]["tokens"][-1]


def test_top_logprobs_hold_the_sampled_token(url):
    c = completion(url, prompt="sample me", temperature=1.5, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)
    lp = c["choices"][0]["logprobs"]
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[tok] == pytest.approx(value) and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in lp["top_logprobs"]), "at 1.5 some draw is not the most likely token"


def test_text_offset_indexes_text_when_the_echoed_prompt_holds_special_tokens(url):
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    c = completion(url, prompt=prompt, echo=True, logprobs=1, max_tokens=4, ignore_eos=True,
                   add_special_tokens=False)["choices"][0]
    lp, text = c["logprobs"], c["text"]
    assert text.startswith(prompt) and lp["tokens"][0] == "<|im_start|>"
    for tok, at in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[at:at + len(tok)] == tok
    assert "".join(lp["tokens"]) == text


# ---------------------------------------------------------------------------- implemented fields


def test_min_p_one_is_greedy(url):
    greedy = completion(url, prompt="min p", max_tokens=10, ignore_eos=True)["choices"][0]["text"]
    hot = dict(prompt="min p", max_tokens=10, ignore_eos=True, temperature=2.0, seed=5)
    assert completion(url, min_p=1.0, **hot)["choices"][0]["text"] == greedy
    assert completion(url, min_p=0.0, **hot)["choices"][0]["text"] != greedy


def test_continuous_usage_stats_puts_usage_on_every_chunk(url):
    body = {"model": BASE, "prompt": "count", "temperature": 0, "max_tokens": 5, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_chunks(url, "/v1/completions", body)
    counts = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert all(ch["usage"]["prompt_tokens"] == 6 for ch in chunks)  # BOS + 5 bytes
    assert counts == sorted(counts) and counts[-1] == 5 and len(chunks) >= 5
    plain = sse_chunks(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert [ch["usage"] for ch in plain[:-1]] == [None] * (len(plain) - 1)
    assert plain[-1]["usage"]["completion_tokens"] == 5
    alone = sse_chunks(url, "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in ch for ch in alone)  # vLLM: only with include_usage
    chat_body = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": USER}
    chat_chunks = sse_chunks(url, "/v1/chat/completions", chat_body)
    assert all(ch["usage"] is not None for ch in chat_chunks) and chat_chunks[-1]["usage"]["completion_tokens"] == 5


def test_completions_take_max_completion_tokens_as_max_tokens(url):
    """guidellm sends max_completion_tokens (chat's newer name) beside max_tokens to /v1/completions: alone it is the
    completion's length, beside an equal max_tokens it changes nothing, beside a different one it is a 400 naming
    it; OpenAI's stream_options.include_obfuscation (padding against length side channels) is accepted."""
    body = {"model": BASE, "prompt": "count", "temperature": 0, "ignore_eos": True}
    for fields in ({"max_completion_tokens": 5}, {"max_completion_tokens": 5, "max_tokens": 5}):
        r = post(url, "/v1/completions", {**body, **fields})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    r = post(url, "/v1/completions", {**body, "max_tokens": 4, "max_completion_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    chunks = sse_chunks(url, "/v1/completions", {**body, "max_tokens": 3, "stream_options": {
        "include_usage": True, "include_obfuscation": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_skip_special_tokens(url):
    forced = dict(prompt="sp", max_tokens=3, ignore_eos=True, logit_bias={str(IM_START): 100}, logprobs=0)
    skipped = completion(url, **forced)["choices"][0]
    kept = completion(url, skip_special_tokens=False, **forced)["choices"][0]
    assert skipped["text"] == "" and skipped["logprobs"]["tokens"] == ["", "", ""]
    assert kept["text"] == "<|im_start|>" * 3 and kept["logprobs"]["tokens"] == ["<|im_start|>"] * 3
    assert kept["logprobs"]["text_offset"] == [0, 12, 24]
    r = post(url, "/v1/completions", {"prompt": "a", "skip_special_tokens": False,
                                      "spaces_between_special_tokens": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "spaces_between_special_tokens"
    no_specials = completion(url, spaces_between_special_tokens=False, **forced)["choices"][0]
    assert no_specials["text"] == skipped["text"]  # no special token in the text: nothing to space


def test_prompt_logprobs(url):
    c = completion(url, prompt="prompt lp", prompt_logprobs=2, echo=True, logprobs=1, max_tokens=1)["choices"][0]
    plp, echo = c["prompt_logprobs"], c["logprobs"]
    ids = completion(url, prompt="prompt lp", max_tokens=1, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    assert plp[0] is None and len(plp) == len(ids) == 10
    for i in range(1, len(ids)):
        entry = plp[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(echo["token_logprobs"][i], abs=1e-5)
        assert entry["decoded_token"] == echo["tokens"][i] and entry["rank"] >= 1
        assert sorted(v["rank"] for v in plp[i].values())[:2] == [1, 2] and len(plp[i]) <= 3
    assert completion(url, prompt="prompt lp")["choices"][0]["prompt_logprobs"] is None
    m = chat(url, USER, prompt_logprobs=0)
    assert m["prompt_logprobs"][0] is None and all(len(e) == 1 for e in m["prompt_logprobs"][1:])
    assert len(m["prompt_logprobs"]) == m["usage"]["prompt_tokens"]


def test_add_special_tokens(url):
    n = len(b"special")
    assert completion(url, prompt="special")["usage"]["prompt_tokens"] == n + 1  # BOS by default (vLLM's)
    assert completion(url, prompt="special", add_special_tokens=False)["usage"]["prompt_tokens"] == n
    base = chat(url, USER)["usage"]["prompt_tokens"]  # chat: the template writes its own (default false)
    assert chat(url, USER, add_special_tokens=True)["usage"]["prompt_tokens"] == base + 1
    tok = post(url, "/tokenize", {"prompt": "special"}).json()
    assert tok["tokens"][0] == BOS and tok["count"] == n + 1
    assert post(url, "/tokenize", {"prompt": "special", "add_special_tokens": False}).json()["count"] == n
    msgs = post(url, "/tokenize", {"messages": USER}).json()
    assert msgs["count"] == base and msgs["tokens"][0] == IM_START


def test_chat_template_kwargs(url):
    plain = post(url, "/tokenize", {"messages": USER}).json()
    off = post(url, "/tokenize", {"messages": USER, "chat_template_kwargs": {"enable_thinking": False},
                                  "return_token_strs": True}).json()
    assert off["count"] == plain["count"] + len("<think></think>")
    assert off["token_strs"][-len("<think></think>"):] == list("<think></think>")  # the vocabulary's strings
    a, b = chat(url, USER), chat(url, USER, chat_template_kwargs={"enable_thinking": False})
    assert b["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"] + len("<think></think>")


def prompt_text(url, **body) -> str:
    """The prompt a chat request fed the model, as text (the byte tokenizer: ids below 256 are bytes)."""
    r = post(url, "/v1/chat/completions", {"model": BASE, "messages": USER, "max_tokens": 1, "return_token_ids": True,
                                           **body})
    assert r.status_code == 200, r.text
    ids = r.json()["prompt_token_ids"]
    return bytes(i for i in ids if i < 256).decode()


def test_reasoning_effort_is_a_template_variable_and_none_turns_thinking_off(url):
    plain = prompt_text(url)
    assert plain.endswith("assistant\n") and "[" not in plain
    assert prompt_text(url, reasoning_effort="high") == plain + "[high]"  # enable_thinking true: the template's own
    assert prompt_text(url, reasoning_effort="none") == plain + "[none]<think></think>"
    # the request's chat_template_kwargs win over what reasoning_effort sets
    assert prompt_text(url, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == plain + "[none]"
    assert prompt_text(url, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "max"}) == plain + "[max]"
    r = post(url, "/v1/chat/completions", {"model": BASE, "messages": USER, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    # the Responses API's reasoning.effort is chat's reasoning_effort
    r = post(url, "/v1/responses", {"model": BASE, "input": "hi there", "max_output_tokens": 1,
                                    "reasoning": {"effort": "none", "summary": "auto"}})
    assert r.status_code == 200, r.text
    chat_none = chat(url, USER, max_tokens=1, reasoning_effort="none")["usage"]["prompt_tokens"]
    assert r.json()["usage"]["input_tokens"] == chat_none
    r = post(url, "/v1/responses", {"model": BASE, "input": "hi there", "reasoning": {"effort": "extreme"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning", r.text


def test_continue_final_message_and_chat_echo(url):
    msgs = [*USER, {"role": "assistant", "content": "the answer is"}]
    body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
            "return_token_strs": True}
    toks = post(url, "/tokenize", body).json()
    text = post(url, "/detokenize", {"tokens": toks["tokens"]}).json()["prompt"]
    # the vocabulary's strings (byte-level: a space reads as 'Ġ'); the assistant turn is left open
    assert toks["token_strs"][-len("the answer is"):] == ["\u0120" if ch == " " else ch for ch in "the answer is"]
    assert text.endswith("assistant\nthe answer is") and toks["tokens"].count(EOS) == 1
    both = post(url, "/v1/chat/completions", {"messages": msgs, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    kw = dict(add_generation_prompt=False, continue_final_message=True, max_tokens=6, ignore_eos=True)
    cont = chat(url, msgs, **kw)["choices"][0]["message"]["content"]
    raw = completion(url, prompt=toks["tokens"], max_tokens=6, ignore_eos=True)["choices"][0]["text"]
    assert cont == raw
    echoed = chat(url, msgs, echo=True, **kw)["choices"][0]["message"]["content"]
    assert echoed == "the answer is" + cont
    chunks = sse_chunks(url, "/v1/chat/completions", {"model": BASE, "temperature": 0, "messages": msgs, "echo": True,
                                                      **kw})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == echoed
    user_last = chat(url, USER, echo=True)["choices"][0]["message"]["content"]
    assert user_last == chat(url, USER)["choices"][0]["message"]["content"]  # only the assistant's is echoed


def test_model_is_optional_and_names_the_base(client, url):
    r = post(url, "/v1/completions", {"prompt": "no model", "temperature": 0, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["model"] == BASE
    assert r.json()["choices"][0]["text"] == completion(url, prompt="no model", max_tokens=4)["choices"][0]["text"]
    c = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
    assert c.status_code == 200 and c.json()["model"] == BASE
    named = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "abc"})
    assert named.json()["id"] == "cmpl-abc"


def test_return_tokens_as_token_ids_and_max_logprobs(url):
    c = completion(url, prompt="ids", logprobs=2, echo=True, return_tokens_as_token_ids=True, return_token_ids=True,
                   max_tokens=3, ignore_eos=True)["choices"][0]
    ids = c["prompt_token_ids"] + c["token_ids"]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"][1:] for k in top)
    m = chat(url, USER, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True, return_token_ids=True)
    assert [e["token"] for e in m["choices"][0]["logprobs"]["content"]] == [
        f"token_id:{t}" for t in m["choices"][0]["token_ids"]]
    for path, body, param in (("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
                              ("/v1/completions", {"prompt": "a", "prompt_logprobs": 6}, "prompt_logprobs"),
                              ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 6},
                               "top_logprobs")):
        r = post(url, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param and "max allowed: 5" in r.text, r.text
    assert completion(url, prompt="a", logprobs=5, max_tokens=1)["choices"][0]["logprobs"] is not None


def test_server_wide_token_ids_and_tokenizer_info_off_by_default(model_dir):
    with serving(cpu_app(model_dir, return_tokens_as_token_ids=True)) as u:
        c = completion(u, prompt="abc", logprobs=0, max_tokens=2, ignore_eos=True, return_token_ids=True)
        assert c["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["choices"][0]["token_ids"]]
        plain = completion(u, prompt="abc", logprobs=0, max_tokens=2, ignore_eos=True,
                           return_tokens_as_token_ids=False)  # a request may turn it off
        assert not plain["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
        assert httpx.get(u + "/tokenizer_info", timeout=TIMEOUT).status_code == 404


# ---------------------------------------------------------------------------------- small routes


def test_ping_and_tokenizer_info(url):
    assert httpx.get(url + "/ping", timeout=TIMEOUT).status_code == 200
    assert httpx.post(url + "/ping", timeout=TIMEOUT).status_code == 200
    info = httpx.get(url + "/tokenizer_info", timeout=TIMEOUT).json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["chat_template"] == TEMPLATE
    assert info["eos_token"] == "<|im_end|>" and info["eos_token_id"] == EOS and info["vocab_size"] == 260


# ------------------------------------------------------------------- fields at their off values

OFF_BOTH = {"use_beam_search": False, "length_penalty": 1.0, "early_stopping": False, "truncate_prompt_tokens": None,
            "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
            "guided_decoding_backend": None, "structured_outputs": None, "priority": 0, "request_id": "r-1",
            "return_token_ids": False, "cache_salt": None, "kv_transfer_params": None, "vllm_xargs": None,
            "bad_words": [], "allowed_token_ids": None, "logits_processors": None, "service_tier": "auto",
            "store": False, "metadata": {"k": "v"}, "min_p": 0.0, "top_k": -1, "repetition_penalty": 1.0,
            "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
            "prompt_logprobs": None, "min_tokens": 0, "stop": None, "seed": None, "user": "u", "n": 1,
            "response_format": {"type": "text"}, "best_of": 1, "prompt_cache_key": "k", "stream": False,
            "return_tokens_as_token_ids": None, "ignore_eos": False, "stop_token_ids": None, "logit_bias": None}
OFF_COMPLETIONS = {"suffix": None, "echo": False, "logprobs": None, "prompt_embeds": None, "add_special_tokens": True}
OFF_CHAT = {"tools": None, "tool_choice": "none", "functions": [], "function_call": None, "parallel_tool_calls": True,
            "logprobs": None, "top_logprobs": 0, "reasoning_effort": None, "modalities": ["text"], "prediction": None,
            "web_search_options": None, "audio": None, "documents": None, "chat_template": None,
            "chat_template_kwargs": None, "continue_final_message": False, "add_generation_prompt": True,
            "echo": False, "add_special_tokens": False, "max_completion_tokens": None, "include_reasoning": True}
OFF_CASES = [("completions", k, v) for k, v in {**OFF_BOTH, **OFF_COMPLETIONS}.items()] + [
    ("chat", k, v) for k, v in {**OFF_BOTH, **OFF_CHAT}.items()]


@pytest.fixture(scope="module")
def plain_outputs(url) -> dict[str, str]:
    return {"completions": completion(url, prompt="off value", max_tokens=3)["choices"][0]["text"],
            "chat": chat(url, USER, max_tokens=3)["choices"][0]["message"]["content"]}


@pytest.mark.parametrize("route,field,value", OFF_CASES, ids=[f"{r}-{f}" for r, f, _ in OFF_CASES])
def test_fields_at_their_off_value_are_accepted_and_change_nothing(url, plain_outputs, route, field, value):
    if route == "completions":
        got = completion(url, prompt="off value", max_tokens=3, **{field: value})["choices"][0]["text"]
    else:
        got = chat(url, USER, max_tokens=3, **{field: value})["choices"][0]["message"]["content"]
    assert got == plain_outputs[route]


REFUSED = [("/v1/completions", "use_beam_search", True), ("/v1/completions", "guided_whitespace_pattern", " "),
           ("/v1/completions", "kv_transfer_params", {"do_remote_decode": True}),
           ("/v1/completions", "length_penalty", 0.5), ("/v1/chat/completions", "logits_processors", ["x"]),
           ("/v1/chat/completions", "verbosity", "high"), ("/v1/chat/completions", "prediction",
                                                                   {"type": "content", "content": "x"})]


@pytest.mark.parametrize("path,field,value", REFUSED, ids=[f for _, f, _ in REFUSED])
def test_fields_that_would_change_the_result_are_refused_naming_them(url, path, field, value):
    body = {"prompt": "a"} if "chat" not in path else {"messages": USER}
    r = post(url, path, {**body, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "not implemented" in r.json()["error"]["message"]


def test_a_resent_model_dump_assistant_message_works(client):
    first = client.chat.completions.create(model=BASE, messages=USER, max_tokens=4, temperature=0)
    message = first.choices[0].message.model_dump()
    assert message["refusal"] is None and "tool_calls" in message
    history = [*USER, message, {"role": "user", "content": "and again"}]
    second = client.chat.completions.create(model=BASE, messages=history, max_tokens=4, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")
    tool = [*USER, {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "call-1"}]
    assert client.chat.completions.create(model=BASE, messages=tool, max_tokens=2).choices
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BASE, max_tokens=2, messages=[
            *USER, {"role": "assistant", "content": "x", "refusal": "no"}])
    assert e.value.body["param"] == "refusal"


def test_streamed_completion_equals_whole_with_echo_logprobs_and_n(url):
    body = {"model": BASE, "prompt": "<|im_start|>stream", "echo": True, "logprobs": 1, "prompt_logprobs": 1, "n": 2,
            "max_tokens": 5, "temperature": 1.0, "seed": 9, "ignore_eos": True, "return_token_ids": True}
    whole = completion(url, **body)
    chunks = sse_chunks(url, "/v1/completions", {**body, "stream_options": {"include_usage": True,
                                                                           "continuous_usage_stats": True}})
    for i, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        got = {key: [x for c in mine if c["logprobs"] for x in c["logprobs"][key]] for key in choice["logprobs"]}
        assert got["tokens"] == choice["logprobs"]["tokens"] and got["text_offset"] == choice["logprobs"]["text_offset"]
        # the same tokens, computed in other batches: equal up to float rounding
        assert got["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)
        for a, b in zip(got["top_logprobs"], choice["logprobs"]["top_logprobs"], strict=True):
            assert a == b or a == pytest.approx(b, abs=1e-5)
        assert mine[0]["prompt_logprobs"] == choice["prompt_logprobs"] and mine[-1]["finish_reason"] == "length"
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    assert chunks[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == 10
    assert whole["usage"]["prompt_tokens"] == len(whole["choices"][0]["prompt_token_ids"])  # once, not per choice


PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}[{{ p['type'] }}:"
                  "{{ p['text'] }}]{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                  "assistant\n{% endif %}")


def test_response_role_content_parts_and_no_docs(tmp_path):
    """--response-role names the reply's role (whole and streamed); --chat-template-content-format openai gives the
    template each message's content as text parts; --disable-fastapi-docs serves no /docs or /openapi.json."""
    out, _ = write_model(tmp_path)
    (out / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    app = cpu_app(out, response_role="bot", chat_template_content_format="openai", disable_fastapi_docs=True)
    with serving(app) as u:
        assert chat(u, USER, max_tokens=2)["choices"][0]["message"]["role"] == "bot"
        first = sse_chunks(u, "/v1/chat/completions", {"model": BASE, "messages": USER, "max_tokens": 2})[0]
        assert first["choices"][0]["delta"]["role"] == "bot"
        ids = post(u, "/tokenize", {"model": BASE, "messages": USER}).json()["tokens"]
        text = httpx.post(u + "/detokenize", json={"tokens": ids}, timeout=TIMEOUT).json()["prompt"]
        assert text == "user\n[text:hi there]\nassistant\n"  # the special tokens left out by /detokenize
        assert httpx.get(u + "/docs", timeout=TIMEOUT).status_code == 404
        assert httpx.get(u + "/openapi.json", timeout=TIMEOUT).status_code == 404


def test_prompt_tokens_details_count_the_prefix_caches_tokens(model_dir):
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, whole and in a stream's usage
    chunk (here forced by --enable-force-include-usage): none for a first prompt, its full blocks (block size 4)
    when the same prompt comes again, each prompt once however many choices (absent without the flag: the next
    test)."""
    prompt = "the same long prompt, twice over"  # 32 bytes (+ BOS): 8 full blocks of 4
    with serving(cpu_app(model_dir, enable_prompt_tokens_details=True, enable_force_include_usage=True)) as u:
        first = completion(u, prompt=prompt, max_tokens=2)["usage"]
        again = completion(u, prompt=[prompt, prompt], max_tokens=2, n=2)["usage"]
        # --enable-force-include-usage: the usage chunk without stream_options
        last = sse_chunks(u, "/v1/completions", {"model": BASE, "prompt": prompt, "max_tokens": 2})[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
        streamed = last["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["prompt_tokens"] == 2 * first["prompt_tokens"] == 66
    assert again["prompt_tokens_details"] == {"cached_tokens": 2 * 32}  # the last block recomputed: 32 of 33
    assert streamed["prompt_tokens_details"] == {"cached_tokens": 32}


def test_cache_salt_keeps_a_prefix_to_its_salt(model_dir):
    """vLLM's cache_salt: a prompt's cached blocks serve only requests of the same salt (and none without one)."""
    prompt = "salted prompt of many bytes, over"  # 33 bytes (+ BOS): 8 full blocks of 4 cached
    with serving(cpu_app(model_dir, enable_prompt_tokens_details=True)) as u:
        def cached(**kw):
            return completion(u, prompt=prompt, max_tokens=2, **kw)["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(cache_salt="tenant-a") == 0
        assert cached(cache_salt="tenant-b") == 0  # another salt: nothing shared
        assert cached() == 0  # no salt: the unsalted namespace, empty
        assert cached(cache_salt="tenant-a") == cached(cache_salt="tenant-b") == cached() == 32
        r = post(u, "/v1/completions", {"model": BASE, "prompt": "x", "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_truncate_prompt_tokens_keeps_the_last_k(url):
    """vLLM's: the last k prompt tokens (usage counts them; echo shows them); -1 keeps max_model_len; 0 or more than
    max_model_len is refused."""
    full = completion(url, prompt="0123456789", max_tokens=3)
    cut = completion(url, prompt="0123456789", max_tokens=3, truncate_prompt_tokens=4, echo=True)
    alone = completion(url, prompt="6789", max_tokens=3, add_special_tokens=False)
    assert cut["usage"]["prompt_tokens"] == 4 and full["usage"]["prompt_tokens"] == 11  # BOS + 10
    assert cut["choices"][0]["text"] == "6789" + alone["choices"][0]["text"]
    assert completion(url, prompt="0123", max_tokens=2, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == 5
    r = chat(url, USER, max_tokens=2, truncate_prompt_tokens=3)
    assert r["usage"]["prompt_tokens"] == 3
    for bad in (0, 100_000):
        r = post(url, "/v1/completions", {"model": BASE, "prompt": "x", "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_allowed_token_ids_and_bad_words(url):
    """vLLM's: only the allowed tokens are generated (EOS left out: to max_tokens); a bad word never appears whole
    in the text, at its start or after a space (the free greedy reply holds it)."""
    allowed = [ord(c) for c in "xyz"]
    r = completion(url, prompt="pick", max_tokens=8, temperature=1.0, seed=1, allowed_token_ids=allowed)
    assert set(r["choices"][0]["text"]) <= set("xyz") and r["choices"][0]["finish_reason"] == "length"
    free = completion(url, prompt="the cat", max_tokens=12)["choices"][0]["text"]
    word = free[2:5]
    banned = completion(url, prompt="the cat", max_tokens=12, bad_words=[word])["choices"][0]["text"]
    assert word in free and word not in banned and banned[:2] == free[:2], (free, banned)
    r = chat(url, USER, max_tokens=4, allowed_token_ids=[ord("q")], temperature=0)
    assert r["choices"][0]["message"]["content"] == "qqqq"
    r = post(url, "/v1/completions", {"model": BASE, "prompt": "x", "allowed_token_ids": [5, 10 ** 6]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], r.text


def test_priority_needs_the_priority_policy(url, model_dir):
    """vLLM's: a non-zero priority is refused under fcfs (this server's default), served under
    --scheduling-policy priority (the scheduler's order: tests/engine/test_scheduler.py)."""
    r = post(url, "/v1/completions", {"model": BASE, "prompt": "x", "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    from moelora.engine.config import EngineConfig
    from moelora.engine.loader import build_engine
    from moelora.server.app import build_app
    from moelora.server.async_engine import AsyncEngine
    from moelora.server.serving import ServerConfig

    cfg = EngineConfig(device="cpu", dtype="float32", max_loras=1, max_lora_rank=8, max_num_seqs=4, block_size=4,
                       num_kv_blocks=256, scheduling_policy="priority")
    app = build_app(AsyncEngine(build_engine(model_dir, cfg)), ServerConfig((BASE,), str(model_dir)))
    with serving(app) as u:
        for p in (-2, 0, 7):
            assert completion(u, prompt="x", max_tokens=2, priority=p)["usage"]["completion_tokens"] == 2


def test_usage_has_no_prompt_tokens_details_by_default(url):
    assert "prompt_tokens_details" not in completion(url, prompt="hello", max_tokens=2)["usage"]
