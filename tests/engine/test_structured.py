"""Structured outputs (engine/structured.py) on the tiny byte-level model: every finished output follows its JSON
schema, JSON, regex, choice or grammar, checked by Python's own json / re, not by xgrammar; constrained requests leave
the free ones in their batch as they were alone (overlapped scheduling on); a grammar held back to its start token;
refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moelora.engine.request import SamplingParams
from moelora.engine.structured import StructuredOutput, choice_regex
from moelora.errors import RequestError
from tests.helpers.server import byte_engine

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                          "pet": {"enum": ["cat", "dog"]}}, "required": ["n", "pet"],
          "additionalProperties": False}


def schema_ok(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) <= {"n", "ok", "pet"} and {"n", "pet"} <= set(obj) and type(obj["n"]) is int
            and obj["pet"] in ("cat", "dog") and type(obj.get("ok", True)) is bool)


def object_ok(text: str) -> bool:
    return isinstance(json.loads(text), dict)


CASES = {  # kind, value, the check of a finished output's text
    "json schema": ("json", SCHEMA, schema_ok),
    "json object": ("json_object", None, object_ok),
    "regex": ("regex", r"[0-9]{3}-[a-z]{2}(!|\?)?", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}[!?]?", t) is not None),
    "choice": ("choice", ["yes", "no", "a (b)|c"], lambda t: t in ("yes", "no", "a (b)|c")),
    "grammar": ("grammar", 'root ::= "x" [0-9]+ ("," [0-9]+)* ";"',
                lambda t: re.fullmatch(r"x[0-9]+(,[0-9]+)*;", t) is not None),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return byte_engine(tmp_path_factory.mktemp("structured"))


def run(eng, params: list[SamplingParams], prompts=None) -> list:
    prompts = prompts or [f"prompt {i}:" for i in range(len(params))]
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while eng.has_unfinished():
        eng.step()
    eng.check_blocks()
    return reqs


@pytest.mark.parametrize("case", list(CASES))
def test_finished_outputs_follow_their_format(engine, case):
    kind, value, check = CASES[case]
    so = StructuredOutput.of(kind, value)
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=s, structured=so) for s in range(8)]
    params.append(SamplingParams(max_tokens=160, temperature=0, structured=so))
    reqs = run(engine, params)
    done = [r for r in reqs if r.finish_reason == "stop"]
    assert len(done) >= 6, [(r.finish_reason, r.text) for r in reqs]  # the random model does end most of them
    for r in done:
        assert r.output_ids[-1] in engine.eos and check(r.text), r.text
    for r in reqs:  # one cut by length is still a prefix the format allows: the mask held every token
        assert r.finish_reason in ("stop", "length")


def test_free_requests_beside_constrained_ones_are_as_alone(engine):
    """Greedy free requests give the same tokens with constrained ones in their batch (whose steps sample after
    the previous step is read back) as without them; a step still in flight between calls throughout."""
    free = [SamplingParams(max_tokens=24, temperature=0) for _ in range(4)]
    alone = [r.output_ids for r in run(engine, free, [f"free {i}" for i in range(4)])]
    so = StructuredOutput.of("regex", "[a-c]+;")
    mixed = run(engine, [*free, *(SamplingParams(max_tokens=24, temperature=1.0, seed=i, structured=so)
                                  for i in range(3))], [*(f"free {i}" for i in range(4)), "a", "b", "c"])
    assert [r.output_ids for r in mixed[:4]] == alone
    assert all(re.fullmatch("[a-c]+;", r.text) for r in mixed[4:] if r.finish_reason == "stop")


def mixed_workload() -> tuple[list[str], list[SamplingParams]]:
    """Constrained requests of every kind (sampled, seeded; one held from its `after` token; one with a bad word of
    two tokens) beside free ones with penalties, stop strings and min_tokens."""
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=i, structured=StructuredOutput.of(kind, value))
              for i, (kind, value, _) in enumerate(CASES.values())]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=7, logit_bias={ord("#"): 100},
                              structured=StructuredOutput.of("regex", "[0-9]{2}", after=ord("#"))),
               SamplingParams(max_tokens=30, temperature=0.8, seed=8, bad_words_ids=((ord("e"), ord(" ")),)),
               SamplingParams(max_tokens=30, temperature=0, frequency_penalty=0.7, repetition_penalty=1.2),
               SamplingParams(max_tokens=30, temperature=1.0, seed=9, stop=["e "], min_tokens=3),
               SamplingParams(max_tokens=12, temperature=0, logprobs=2)]
    return [f"mixed {i}:" for i in range(len(params))], params


def test_constrained_steps_overlapped_equal_synchronous(engine, tmp_path):
    """Overlapped scheduling with constrained requests in the batch gives every request the tokens (and logprobs)
    of the synchronous engine."""
    sync = byte_engine(tmp_path, async_scheduling=False)
    prompts, params = mixed_workload()
    want = run(sync, params, prompts)
    got = run(engine, params, prompts)
    for w, g in zip(want, got, strict=True):
        assert (g.output_ids, g.finish_reason, g.text) == (w.output_ids, w.finish_reason, w.text)
        assert [lp[0] for lp in g.logprobs] == pytest.approx([lp[0] for lp in w.logprobs], abs=1e-5)
    assert sum(r.finish_reason == "stop" for r in got[:len(CASES)]) >= 3  # formats completed, not only cut


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_constrained_steps_overlapped_equal_synchronous_on_cuda(tmp_path):
    """The same on CUDA (decode graphs, the masks uploaded from pinned memory while the forward runs): fp32, one
    engine overlapped and one synchronous, tokens identical."""
    prompts, params = mixed_workload()
    want = run(byte_engine(tmp_path / "sync", async_scheduling=False, device="cuda"), params, prompts)
    eng = byte_engine(tmp_path / "overlapped", device="cuda")
    assert eng.graphs is not None
    got = run(eng, params, prompts)
    for w, g in zip(want, got, strict=True):
        assert (g.output_ids, g.finish_reason, g.text) == (w.output_ids, w.finish_reason, w.text)


def test_a_constrained_step_launches_its_forward_before_reading_the_last_one_back(tmp_path, monkeypatch):
    """With a grammar in the batch the host still launches step n+1's forward before it waits for step n's
    tokens (the mask is filled while the forward runs): forward, forward, read back, forward, read back, ...
    (a fresh engine: a shared one may hold a step of finished requests in flight)."""
    from moelora.engine import readback

    engine = byte_engine(tmp_path)
    events = []
    run_forward, get = engine.runner.run, readback.ReadBack.get
    monkeypatch.setattr(engine.runner, "run", lambda *a, **k: events.append("forward") or run_forward(*a, **k))
    monkeypatch.setattr(readback.ReadBack, "get", lambda self: events.append("read") or get(self))
    so = StructuredOutput.of("regex", "[a-z]{30}")
    reqs = run(engine, [SamplingParams(max_tokens=30, temperature=1.0, seed=s, structured=so) for s in range(2)])
    assert all(r.finish_reason == "length" and re.fullmatch("[a-z]{30}", r.text) for r in reqs)
    n = events.count("forward")
    assert n >= 30 and events == ["forward"] + ["forward", "read"] * (n - 1) + ["read"], events


def test_a_grammar_starts_after_its_token(engine):
    """`after`: the output is free up to that token (here forced first by logit_bias), then held."""
    start = ord("#")  # the byte tokenizer's id of "#"
    so = StructuredOutput.of("regex", "[0-9]{2}", after=start)
    reqs = run(engine, [SamplingParams(max_tokens=12, temperature=1.0, seed=s, structured=so,
                                       logit_bias={start: 100}) for s in range(4)])
    for r in reqs:
        assert r.output_ids[0] == start and r.finish_reason == "stop", r.text
        assert re.fullmatch("#[0-9]{2}", r.text), r.text


def test_bad_specs_are_refused_naming_the_problem(engine):
    with pytest.raises(RequestError, match="invalid regex.*parenthesis"):
        engine.add_request("x", SamplingParams(structured=StructuredOutput.of("regex", "a((")))
    with pytest.raises(RequestError, match="not valid JSON"):
        StructuredOutput.of("json", "{nope")
    with pytest.raises(RequestError, match="non-empty list of strings"):
        StructuredOutput.of("choice", [])
    with pytest.raises(RequestError, match="kind must be one of"):
        StructuredOutput("yaml")
    assert not engine.has_unfinished()


def test_choice_regex_escapes_every_metacharacter():
    choices = ["a.b", "(x|y)", "1+1=2?", "[z]", "^$\\/{}*"]
    pattern = choice_regex(choices)
    assert all(re.fullmatch(pattern, c) for c in choices)
    assert not any(re.fullmatch(pattern, c) for c in ("aXb", "x", "11=2", "z"))


def test_with_ignore_eos_a_complete_grammar_still_ends_the_output(engine):
    so = StructuredOutput.of("choice", ["yes", "no"])
    reqs = run(engine, [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True, structured=so)
                        for s in range(3)])
    for r in reqs:
        assert r.finish_reason == "stop" and r.text in ("yes", "no") and r.output_ids[-1] in engine.eos, r.text


def test_a_pydantic_schema_with_definitions_holds(engine):
    """What the openai SDK sends for nested models: $defs / $ref, strict objects."""
    schema = {"$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                                 "age": {"type": "integer"}},
                                "required": ["kind", "age"], "additionalProperties": False}},
              "type": "object", "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"},
                                                        "maxItems": 2}},
              "required": ["pets"], "additionalProperties": False}
    so = StructuredOutput.of("json", schema)
    reqs = run(engine, [SamplingParams(max_tokens=160, temperature=1.0, seed=s, structured=so) for s in range(6)])
    done = [r for r in reqs if r.finish_reason == "stop"]
    assert len(done) >= 3, [r.text for r in reqs]
    for r in done:
        pets = json.loads(r.text)["pets"]
        assert len(pets) <= 2 and all(set(p) == {"kind", "age"} and p["kind"] in ("cat", "dog")
                                      and type(p["age"]) is int for p in pets), r.text


def test_batched_mask_fill_equals_one_by_one(engine, monkeypatch):
    """`Grammars.allowed` from BATCH_FILL_ROWS rows fills the masks in xgrammar's threads: the same masks as one
    matcher at a time, for matchers of several formats at several points of their outputs."""
    import random

    import torch

    import moelora.engine.structured as st

    grammars = engine.grammars()
    rng = random.Random(0)
    matchers = []
    for i in range(12):
        kind, value, _ = CASES[list(CASES)[i % len(CASES)]]
        m = grammars.matcher(StructuredOutput.of(kind, value))
        for _ in range(rng.randrange(6)):  # a few allowed steps in
            ok = grammars.allowed([m], torch.device("cpu"))[0].nonzero().flatten().tolist()
            tok = rng.choice(ok)
            if tok in engine.eos:
                break
            assert m.accept_token(tok)
        matchers.append(m)
    batched = grammars.allowed(matchers, torch.device("cpu"))
    monkeypatch.setattr(st, "BATCH_FILL_ROWS", 10 ** 9)
    assert torch.equal(batched, grammars.allowed(matchers, torch.device("cpu")))
    assert batched.any(dim=1).all() and not batched.all(dim=1).any()


def test_the_offline_api_takes_vllms_structured_outputs(tmp_path):
    """`from moelora.sampling_params import StructuredOutputsParams` where vLLM's was; LLM.generate holds to it."""
    from moelora import LLM
    from moelora.sampling_params import SamplingParams as VllmPathParams
    from moelora.sampling_params import StructuredOutputsParams
    from tests.helpers.server import write_model

    model_dir, _ = write_model(tmp_path)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=1, max_lora_rank=8)
    params = [VllmPathParams(max_tokens=40, temperature=1.0, seed=s,
                             structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])) for s in range(4)]
    outs = llm.generate(["pick:"] * 4, params)
    assert all(o.text in ("alpha", "beta") and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    with pytest.raises(RequestError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"]))
    with pytest.raises(RequestError, match="not both"):
        SamplingParams(structured=StructuredOutput("json_object"),
                       structured_outputs=StructuredOutputsParams(json_object=True))


def test_compact_json_has_no_whitespace_between_tokens(engine):
    """vLLM's disable_any_whitespace (per request: spacing "none"; per server: Grammars(any_whitespace=False),
    --structured-outputs-config): no whitespace outside strings. Spacing "single" (forced tool calls): json.dumps'
    own spacing."""
    so = StructuredOutput.of("json", SCHEMA, spacing="none")
    reqs = run(engine, [SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured=so) for s in range(6)])
    done = [r for r in reqs if r.finish_reason == "stop"]
    assert len(done) >= 3 and all(schema_ok(r.text) and not any(c in r.text for c in " \n\t\r") for r in done)
    loose = StructuredOutput.of("json", SCHEMA)
    import torch

    from moelora.engine.structured import Grammars

    def after_brace(grammars, so):
        m = grammars.matcher(so)
        assert m.accept_token(ord("{"))
        return set(grammars.allowed([m], torch.device("cpu"))[0].nonzero().flatten().tolist())

    ws = {ord(c) for c in " \n\t\r"}
    assert ws & after_brace(engine.grammars(), loose) and not ws & after_brace(engine.grammars(), so)
    server_wide = Grammars(engine.tokenizer, engine.model_config.vocab_size, engine.eos, any_whitespace=False)
    assert not ws & after_brace(server_wide, loose)
    single = StructuredOutput.of("json", SCHEMA, spacing="single")
    reqs = run(engine, [SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured=single) for s in range(6)])
    done = [r for r in reqs if r.finish_reason == "stop"]
    assert len(done) >= 3 and all(schema_ok(r.text) and r.text == json.dumps(json.loads(r.text)) for r in done)
    with pytest.raises(RequestError, match="spacing"):
        StructuredOutput("json", "{}", spacing="tabs")
