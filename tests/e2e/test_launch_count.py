"""benchmarks/launch_count.py: what one prefill forward launches, counted on the CPU under the Triton interpreter.

The counts are the host's work on the GPU too (each Triton launch ~50-100 us of Python there): a change that
adds a launch to a prefill layer shows here, and this test names the launches a layer makes today. Its prompts
(2 x 9 tokens) are past `split.ROWS_MAX` (16) rows: up to it the dense LoRA takes decode's row kernels."""

from __future__ import annotations

from collections import Counter

import pytest

pytestmark = pytest.mark.interp  # `make test` runs it with TRITON_INTERPRET=1
pytest.importorskip("triton")

from tests.helpers.kernel_env import INTERP  # noqa: E402
from tests.helpers.scripts import load_script  # noqa: E402

launch_count = load_script("benchmarks/launch_count.py", skip_missing=True)

# the q/k rotation also writes k and v into the cache (`rotary.qk_norm_rope`'s kv_store: no `_store_kv_kernel`)
BASE = Counter({"_rms_norm_kernel": 2, "_qk_norm_rope_kernel": 1, "_prefill_kernel": 1,
                "_softmax_topk_kernel": 1, "_plan_expert_kernel": 1, "gate_up_kernel": 1, "down_kernel": 1,
                "combine_kernel": 1})
# q/k/v (one merged site) and o: a shrink and an expand each; the routed experts ("stacked", the H200 table's
# pick at M=4096): a shrink before each GEMM, the expand inside the GEMMs
LORA = Counter({"_lora_shrink_kernel": 2, "_lora_expand_add_kernel": 2, "lora_stacked_shrink_kernel": 2})


@pytest.mark.skipif(not INTERP, reason="counts a CPU forward under TRITON_INTERPRET=1")
def test_a_prefill_layer_launches_these_kernels(tmp_path):
    rows = launch_count.main(["--prompts", "2", "--len", "9", "--layers", "1", "--host-runs", "1", "--piecewise",
                              "--json", str(tmp_path / "counts.json")])
    got = {r["workload"]: r for r in rows}
    assert list(got) == list(launch_count.WORKLOADS)
    assert Counter(got["no LoRA"]["launches"]["layer"]) == BASE
    for label in ("1 adapter", "8 adapters"):
        assert Counter(got[label]["launches"]["layer"]) == BASE + LORA, label
    for r in rows:  # outside the layers: the final norm (the LM head is cuBLAS); no LoRA launch per step
        assert r["launches"]["step"] == {"_rms_norm_kernel": 1}
        assert r["layer_ops"] > 0 and r["layer_calls"] > 0 and r["step_ops"] > 0
    assert (tmp_path / "counts.json").read_text().startswith("[")
    assert_piecewise_launches(rows, {"_prefill_kernel": 1}, {})


# DeepSeek-V2-Lite's layer: MLA (rotations, latent norm and cache store in one launch; the attention of every
# sequence in one, `mla_prefill`), the greedy top k, shared experts (one SiLU·up, their output summed by the next norm)
DSV2_BASE = Counter({"_rms_norm_kernel": 2, "_mla_rope_store_kernel": 1, "_mla_prefill_kernel": 1,
                     "_softmax_topk_kernel": 1, "_plan_expert_kernel": 1, "gate_up_kernel": 1, "down_kernel": 1,
                     "combine_kernel": 1, "_silu_mul_kernel": 1})
# q + kv_a (one merged site), kv_b, o, the shared experts' gate_up and down: a shrink and an expand each
DSV2_LORA = Counter({"_lora_shrink_kernel": 5, "_lora_expand_add_kernel": 5, "lora_stacked_shrink_kernel": 2})


@pytest.mark.skipif(not INTERP, reason="counts a CPU forward under TRITON_INTERPRET=1")
def test_a_deepseek_v2_prefill_layer_launches_these_kernels():
    rows = launch_count.main(["--model", "dsv2", "--prompts", "2", "--len", "9", "--layers", "1", "--host-runs",
                              "1", "--piecewise"])
    got = {r["workload"]: r for r in rows}
    assert Counter(got["no LoRA"]["launches"]["layer"]) == DSV2_BASE
    for label in ("1 adapter", "8 adapters"):
        assert Counter(got[label]["launches"]["layer"]) == DSV2_BASE + DSV2_LORA, label
    assert "scaled_dot_product_attention" not in got["no LoRA"]["ops"]["layer"]  # no SDPA a sequence
    # MLA's attention expands the context's latents through kv_b, each row with its sequence's adapter
    assert_piecewise_launches(rows, {"_mla_prefill_kernel": 1},
                              {"_lora_shrink_kernel": 1, "_lora_expand_add_kernel": 1})


def assert_piecewise_launches(rows: list[dict], attention: dict, lora: dict) -> None:
    """--piecewise: through the piecewise graphs (replays stubbed) the host launches each layer's attention and
    nothing else (the rest of every layer, its LoRA included, is in the graphs)."""
    for r in rows:
        want = Counter(attention) + (Counter(lora) if r["workload"] != "no LoRA" else Counter())
        assert Counter(r["piecewise_launches"]) == want, r["workload"]
        assert r["eager_ms"] > 0 and r["piecewise_ms"] > 0
