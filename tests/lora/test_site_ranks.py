"""Per-site LoRA ranks: every site owns a fixed-address `lora_ranks [S]` int32 buffer holding the rank
of the weights written into each slot there (0: the slot is empty or its adapter does not cover the
site), and hands it to the kernels instead of the adapter's global rank. Loading, removing and
evicting adapters keep the buffers right; `.to()` keeps them; outputs do not change.
"""

from __future__ import annotations

import pytest
import torch

from moelora.kernels.dense_policy import DenseLoRAPolicy
from moelora.layers.linear import Linear
from moelora.lora.adapter import LoRAAdapter, LoRAWeights
from moelora.lora.batch import LoRABatch, LoRANeeds, plan_step
from moelora.models.decoder import MoECausalLM
from tests.helpers.models import build, engine, merged_hf
from tests.helpers.oracle import tiny_hf_model

SLOTS, RANK = 3, 8


def partial_adapter(model: MoECausalLM, name: str, seed: int, ranks: dict[str, int]) -> LoRAAdapter:
    """Random non-zero LoRA on the sites whose key ends with one of `ranks`' suffixes, at that rank."""
    g = torch.Generator().manual_seed(seed)
    sites = {}
    for key, (mod, proj) in model.lora_sites().items():
        rank = next((r for suffix, r in ranks.items() if key.endswith(suffix)), 0)
        if not rank:
            continue
        if proj is None:
            shape_a, shape_b = (rank, mod.in_features), (mod.out_features, rank)
        else:
            a_buf, b_buf = getattr(mod, f"lora_{proj}_a"), getattr(mod, f"lora_{proj}_b")
            shape_a, shape_b = (a_buf.shape[1], rank, a_buf.shape[3]), (b_buf.shape[1], b_buf.shape[2], rank)
        sites[key] = LoRAWeights(0.2 * torch.randn(shape_a, generator=g), 0.2 * torch.randn(shape_b, generator=g))
    return LoRAAdapter(name, "", sites)


def site_ranks(model: MoECausalLM) -> dict[str, list[int]]:
    """Site key -> its ranks buffer as a host list (the buffer that site hands its kernels)."""
    out = {}
    for key, (mod, proj) in model.lora_sites().items():
        buf = mod.lora_ranks if proj is None else getattr(mod, f"lora_{proj}_ranks")
        out[key] = buf.tolist()
    return out


def expected(model: MoECausalLM, by_slot: dict[int, LoRAAdapter]) -> dict[str, list[int]]:
    want = {key: [0] * SLOTS for key in model.lora_sites()}
    for slot, adapter in by_slot.items():
        for key, w in adapter.sites.items():
            want[key][slot] = w.rank
    return want


# Attention q/v at rank 3, routed gate_up at 5, the dense MLP's down at 8; no o/k, no router gate, no
# expert down: those sites must read rank 0 for this adapter's slot.
PARTIAL = {"self_attn.q_proj": 3, "self_attn.v_proj": 3, "experts.gate_up": 5, "mlp.down_proj": 8}
OTHER = {"self_attn.o_proj": 2, "mlp.gate": 4, "experts.down": 6}


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("qwen3_moe", seed=31)


def test_set_lora_slot_writes_each_sites_rank(hf):
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    a, b = partial_adapter(model, "a", 1, PARTIAL), partial_adapter(model, "b", 2, OTHER)
    assert site_ranks(model) == expected(model, {})
    model.set_lora_slot(1, a)
    model.set_lora_slot(2, b)
    got = site_ranks(model)
    assert got == expected(model, {1: a, 2: b})
    assert got["model.layers.0.self_attn.q_proj"] == [0, 3, 0]
    assert got["model.layers.0.self_attn.o_proj"] == [0, 0, 2]
    assert got["model.layers.0.mlp.gate"] == [0, 0, 4]
    assert got["model.layers.0.mlp.experts.gate_up"] == [0, 5, 0]
    assert got["model.layers.0.mlp.experts.down"] == [0, 0, 6]
    assert got["model.layers.0.self_attn.k_proj"] == [0, 0, 0]
    model.set_lora_slot(2, a)  # overwrite: b's sites go back to 0
    assert site_ranks(model) == expected(model, {1: a, 2: a})
    model.set_lora_slot(1, None)
    assert site_ranks(model) == expected(model, {2: a})


def test_ranks_buffers_are_fixed_address_non_persistent_and_move_with_the_model(hf):
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    lin = model.model.layers[0].self_attn.q_proj
    experts = model.model.layers[0].mlp.experts
    ptrs = [lin.lora_ranks.data_ptr(), experts.lora_gate_up_ranks.data_ptr(), experts.lora_down_ranks.data_ptr()]
    model.set_lora_slot(0, partial_adapter(model, "a", 1, PARTIAL))
    model.set_lora_slot(0, None)
    model.set_lora_slot(1, partial_adapter(model, "b", 2, OTHER))
    assert ptrs == [lin.lora_ranks.data_ptr(), experts.lora_gate_up_ranks.data_ptr(),
                    experts.lora_down_ranks.data_ptr()]
    assert not any(k.endswith("ranks") for k in model.state_dict())
    buffers = dict(model.named_buffers())
    assert "model.layers.0.self_attn.o_proj.lora_ranks" in buffers
    # q/k/v are segments of one merged projection: their ranks are rows of its [3, S] buffer
    assert tuple(buffers["model.layers.0.self_attn.qkv_proj.lora_ranks"].shape) == (3, SLOTS)
    assert "model.layers.0.self_attn.q_proj.lora_ranks" not in buffers
    assert "model.layers.0.mlp.experts.lora_gate_up_ranks" in buffers
    before = site_ranks(model)
    moved = model.to(torch.float64).to("cpu")  # a dtype move keeps the int32 ranks (values and dtype)
    assert site_ranks(moved) == before
    assert lin.lora_ranks.dtype == torch.int32 and experts.lora_down_ranks.dtype == torch.int32


def test_sites_hand_their_own_ranks_to_the_kernels(hf):
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    model.set_lora_slot(1, partial_adapter(model, "a", 1, PARTIAL))
    batch = LoRABatch.build([1, -1, 1], [0, RANK, 0], "cpu")
    lin = model.model.layers[0].self_attn.o_proj
    args = lin.lora_args(batch)
    assert args.slot_ranks is lin.lora_ranks and args.slot_ranks.tolist() == [0, 0, 0]
    router = model.model.layers[0].mlp.gate
    assert isinstance(router, Linear) and router.lora_args(batch).slot_ranks is router.lora_ranks
    experts = model.model.layers[0].mlp.experts  # each projection's kernels read that projection's ranks
    ex_args = experts.lora_args(batch)
    assert ex_args.gate_up_ranks is experts.lora_gate_up_ranks and ex_args.down_ranks is experts.lora_down_ranks
    assert (ex_args.gate_up_ranks[1].item(), ex_args.down_ranks[1].item()) == (PARTIAL["experts.gate_up"], 0)


def test_batch_width_is_its_slots_largest_rank(hf):
    """`LoRABatch.max_rank`: the largest adapter rank among the slots the rows name (not the pool's),
    handed to every site as its kernels' width; None (switched off, or a batch built without it): the pool's."""
    assert LoRABatch.build([2, -1, 0, 2], [8, 64, 4], "cpu").max_rank == 8
    assert LoRABatch.build([1, 1], [8, 64, 4], "cpu", rows=False).max_rank == 64
    assert LoRABatch.build([-1, -1], [8, 64, 4], "cpu").max_rank == 0
    assert LoRABatch.build([1, 1], [8, 64, 4], "cpu", width=False).max_rank is None  # lora_width_by_batch off
    batch = LoRABatch.build([1, -1, 1], [0, 5, 0], "cpu")
    needs = LoRANeeds(group_slots=SLOTS)
    assert plan_step(batch.token_slots, batch.active, batch.max_rank, None, needs).max_rank == 5
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    layer = model.model.layers[0]
    assert layer.self_attn.o_proj.lora_args(batch).width == 5
    assert layer.mlp.experts.lora_args(batch).width == 5
    unknown = LoRABatch(batch.token_slots, batch.active)
    assert unknown.max_rank is None and layer.mlp.experts.lora_args(unknown).width is None


def test_batch_slots_are_the_named_slots_with_weights(hf):
    """`LoRABatch.slots` (dense LoRA's "concat" lanes): the slots the rows name whose adapter has a rank, ascending,
    from the same copy as the token slots, whether or not the twins' rows are built; every dense site passes them
    on, and rows given their own slots (`forward_rows`) drop them."""
    for rows in (True, False):
        batch = LoRABatch.build([3, -1, 0, 3, 2, 0], [4, 8, 0, 16], "cpu", rows=rows)
        assert batch.slots.dtype == torch.int32 and batch.slots.tolist() == [0, 3]  # slot 2: rank 0
        assert batch.token_slots.tolist() == [3, -1, 0, 3, 2, 0]
    assert LoRABatch.build([-1, -1], [4, 8], "cpu").slots.tolist() == []
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    batch = LoRABatch.build([1, -1, 1], [0, 5, 0], "cpu")
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.lora_args(batch).slots is batch.slots
    assert LoRABatch(batch.token_slots, batch.active).slots is None  # a graph runner's batch: unknown


class NeverGrouped(DenseLoRAPolicy):
    def wants_row_plan(self, num_tokens: int) -> bool:
        return False


def test_plan_step_gives_each_batch_what_the_runner_needs():
    """`plan_step`, the one builder of the eager and the graph runners' batches: the idle sites, the width
    (None when switched off), the side stream, and the rows grouped by slot only where the needs ask for it
    and the dense policy wants it at this many rows."""
    slots = torch.tensor([1, -1, 1] * 7, dtype=torch.int32)
    idle = frozenset({"a site"})
    batch = plan_step(slots[:3], None, 5, None, LoRANeeds(rows=False, group_slots=SLOTS), idle)
    assert batch.idle is idle and batch.max_rank == 5 and batch.active is None
    assert batch.row_plan is None and batch.side_stream is None  # 3 rows: the shipped policy groups none
    assert plan_step(slots, None, 5, None, LoRANeeds(width=False), idle).max_rank is None
    assert plan_step(slots, None, 5, None, LoRANeeds(group_slots=SLOTS, policy=NeverGrouped())).row_plan is None
    assert plan_step(slots, None, 5, None, LoRANeeds(group_slots=0)).row_plan is None  # group_lora_rows off


def test_engine_steps_carry_their_width_unless_switched_off(hf):
    """`EngineConfig.lora_width_by_batch`: an eager step's batch carries its adapters' largest rank (the
    pool's slot_ranks: the adapter's largest site rank), or None when the switch is off; outputs equal."""
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    adapter = partial_adapter(model, "a", 1, PARTIAL)
    seen, logits = [], []
    for on in (True, False):
        eng = engine(model, {"a": adapter}, max_loras=SLOTS, lora_width_by_batch=on)
        run = eng.runner.run

        def spy(inputs, all_logits=False, rows_fn=None, run=run):
            seen.append(inputs.lora.max_rank)
            return run(inputs, all_logits, rows_fn)
        eng.runner.run = spy
        logits.append(eng.prompt_logits([[5, 6, 7, 8]], ["a"])[0])
    assert seen == [adapter.max_rank, None] and adapter.max_rank == max(PARTIAL.values())
    assert torch.equal(logits[0], logits[1])


def test_graph_width_classes():
    """The decode graphs' LoRA width: a class (power of two >= 16) serving every rank up to it; a step of
    wider adapters, or of unknown width, is not served (the runner re-captures first); None serves all."""
    from types import SimpleNamespace

    from moelora.engine.cuda_graphs import CudaGraphRunner

    assert [CudaGraphRunner.width_class(r) for r in (None, 0, 8, 16, 17, 40, 64)] == [None, 16, 16, 16, 32, 64, 64]
    holds = CudaGraphRunner.holds
    assert holds(SimpleNamespace(lora_width=16), 16) and holds(SimpleNamespace(lora_width=16), 0)
    assert not holds(SimpleNamespace(lora_width=16), 17) and not holds(SimpleNamespace(lora_width=16), None)
    assert holds(SimpleNamespace(lora_width=None), 64) and holds(SimpleNamespace(lora_width=None), None)


def test_pool_eviction_and_removal_zero_site_ranks(hf):
    model = build(hf, max_loras=1, max_rank=RANK)
    a, b = partial_adapter(model, "a", 1, PARTIAL), partial_adapter(model, "b", 2, OTHER)
    eng = engine(model, {"a": a, "b": b}, max_loras=1)
    ranks_of = lambda: {k: v[0] for k, v in site_ranks(model).items()}  # noqa: E731
    eng.pool.acquire(["a"])
    assert ranks_of() == {k: (a.sites[k].rank if k in a.sites else 0) for k in model.lora_sites()}
    eng.pool.acquire(["b"])  # evicts a from the only slot
    assert eng.pool.evictions == 1
    assert ranks_of() == {k: (b.sites[k].rank if k in b.sites else 0) for k in model.lora_sites()}
    eng.pool.remove("b")
    assert set(ranks_of().values()) == {0}


def test_partial_adapters_equal_merged_weights_and_mix(hf):
    """Outputs with site ranks: each partial adapter equals its merged-weight oracle, and a mixed batch
    of both and the base equals each row alone."""
    model = build(hf, max_loras=2, max_rank=RANK)
    adapters = {"a": partial_adapter(model, "a", 1, PARTIAL), "b": partial_adapter(model, "b", 2, OTHER)}
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 3, 7)]
    names = ["a", None, "b"]
    eng = engine(model, adapters, max_loras=2)
    mixed = eng.prompt_logits(seqs, names)
    for seq, name, got in zip(seqs, names, mixed, strict=True):
        alone = eng.prompt_logits([seq], [name])[0]
        assert (got - alone).abs().max() < 1e-5
        with torch.no_grad():
            ref = (hf if name is None else merged_hf(hf, adapters[name]))(torch.tensor([seq])).logits[0]
        assert (got - ref).abs().max() < 1e-4


def test_triton_only_batch_has_no_rows_and_the_twins_refuse_it(hf):
    """The runner builds a Triton-backend batch without the per-slot rows; a torch-backend layer
    given one must fail loudly, not compute without LoRA."""
    full = LoRABatch.build([1, -1, 1, 0], [4, RANK, 0], "cpu")
    lean = LoRABatch.build([1, -1, 1, 0], [4, RANK, 0], "cpu", rows=False)
    assert lean.active is None and torch.equal(lean.token_slots, full.token_slots)
    assert [(s.slot, s.rows.tolist()) for s in full.active] == [(0, [3]), (1, [0, 2])]
    with pytest.raises(ValueError, match="slot 5"):
        LoRABatch.build([5, -1], [4, RANK], "cpu", rows=False)
    model = build(hf, max_loras=SLOTS, max_rank=RANK)
    lin = model.model.layers[0].self_attn.o_proj
    x = torch.randn(4, lin.in_features, dtype=lin.weight.dtype)
    with pytest.raises(ValueError, match="per-slot rows"):
        lin(x, lean)
