"""Offline code written against vLLM's `LLM` (the bundled demo, CPU): `lora_request=LoRARequest(name, id, path)`
serves the request with that adapter (registered from its path at first use) exactly as `adapter=name` does;
`out.outputs[0]` is vLLM's view of the result; `enable_lora` / `trust_remote_code` are accepted and
`enable_expert_parallel` is the engine's `expert_parallel`; `seed` and `tokenizer` as vLLM's."""

from __future__ import annotations

import pytest

from moelora import LLM, SamplingParams
from moelora.demo import ADAPTER_NAMES, adapter_dir, model_dir
from moelora.errors import RequestError
from moelora.lora.request import LoRARequest

PROMPTS = ["hello world", "moe lora"]


@pytest.fixture(scope="module")
def llm():
    if not (model_dir() / "model.safetensors").is_file():
        pytest.skip("the bundled demo model is not built yet")
    return LLM(model_dir(), device="cpu", enable_lora=True, trust_remote_code=True, enable_expert_parallel=False,
               max_loras=2)


def test_lora_request_is_the_named_adapter(llm):
    name, path = ADAPTER_NAMES[0], str(adapter_dir(ADAPTER_NAMES[0]))
    greedy = SamplingParams(max_tokens=8, temperature=0)
    by_request = llm.generate(PROMPTS, greedy, lora_request=LoRARequest(name, 1, path))
    assert name in llm.adapters and llm.engine.cfg.expert_parallel is False
    by_name = llm.generate(PROMPTS, greedy, adapter=name)
    base = llm.generate(PROMPTS, greedy)
    assert [o.token_ids for o in by_request] == [o.token_ids for o in by_name]
    assert [o.token_ids for o in by_request] != [o.token_ids for o in base]
    mixed = llm.generate(PROMPTS, greedy, lora_request=[None, LoRARequest(name, 1, path)])
    assert [o.token_ids for o in mixed] == [base[0].token_ids, by_name[1].token_ids]
    out = by_request[0].outputs
    assert len(out) == 1 and (out[0].index, out[0].text, out[0].token_ids, out[0].finish_reason) == (
        0, by_request[0].text, by_request[0].token_ids, by_request[0].finish_reason)
    chat = llm.chat([{"role": "user", "content": "hi"}], greedy, lora_request=LoRARequest(name, 1))  # registered
    assert chat[0].adapter == name


def test_lora_request_refusals(llm, tmp_path):
    name, path = ADAPTER_NAMES[1], str(adapter_dir(ADAPTER_NAMES[1]))
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1), lora_request=LoRARequest(name, 2, path))
    with pytest.raises(RequestError, match=f"adapter '{name}' is registered from"):
        llm.generate(PROMPTS[:1], lora_request=LoRARequest(name, 2, str(tmp_path)))
    with pytest.raises(RequestError, match="not both"):
        llm.generate(PROMPTS[:1], adapter=name, lora_request=LoRARequest(name, 2, path))
    with pytest.raises(RequestError, match="no adapter of that name and no lora_path"):
        llm.generate(PROMPTS[:1], lora_request=LoRARequest("unknown", 3))
    with pytest.raises(RequestError, match="positive integer"):
        LoRARequest(name, 0, path)
    assert not llm.engine.has_unfinished()


def test_seed_and_tokenizer_arguments():
    """vLLM's LLM(seed=..., tokenizer=...): two engines seeded alike draw the same unseeded samples; the tokenizer
    directory is read."""
    if not (model_dir() / "model.safetensors").is_file():
        pytest.skip("the bundled demo model is not built yet")
    params = SamplingParams(max_tokens=16, temperature=2.0, ignore_eos=True)
    runs = [LLM(model_dir(), device="cpu", seed=7, tokenizer=str(model_dir())).generate(PROMPTS, params)
            for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    other = LLM(model_dir(), device="cpu", seed=8).generate(PROMPTS, params)
    assert [o.token_ids for o in other] != [o.token_ids for o in runs[0]]
