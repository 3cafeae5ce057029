"""benchmarks/moe_bench_common.py, the MoE benchmarks' shared layer and LoRA builders: the rows' slots of each
order (their pure parts, on the CPU)."""

from __future__ import annotations

import pytest

from tests.helpers.scripts import load_script

common = load_script("benchmarks/moe_bench_common.py")


def test_make_lora_orders_place_the_rows_slots():
    """The benchmarks' row orders: decode's interleaved adapters, prefill's runs of one adapter, and a one-prompt
    chunk on the pool's last slot (where "stacked" has the most lanes ahead of the live one)."""
    SLOTS, make_layer, make_lora = common.SLOTS, common.make_layer, common.make_lora
    layer = make_layer(dict(E=4, K=2, H=64, I=32), pool_ranks=(16,), device="cpu")
    slots = {o: make_lora(layer, 8, "8ad_r16", o).token_slots.tolist() for o in ("interleaved", "grouped", "last")}
    assert slots == {"interleaved": [0, 1, 2, 3, 4, 5, 6, 7], "grouped": [0, 1, 2, 3, 4, 5, 6, 7],
                     "last": [SLOTS - 1] * 8}
    assert make_lora(layer, 16, "8ad_r16", "grouped").token_slots.tolist() == [s // 2 for s in range(16)]
    assert make_lora(layer, 16, "8ad_r16", "interleaved").token_slots.tolist() == [s % 8 for s in range(16)]
    with pytest.raises(ValueError, match="order must be one of"):
        make_lora(layer, 8, "8ad_r16", "sorted")
