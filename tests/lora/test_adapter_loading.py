"""Loading adapters without stalling the batch: the pool's `ensure` (admission) with slot writes
that finish later, the scheduler admitting other requests meanwhile, and the engine's output
unchanged by when the writes complete."""

from __future__ import annotations

import torch

from moelora.engine.kv_cache import BlockAllocator
from moelora.engine.request import SamplingParams
from moelora.engine.scheduler import Scheduler, SchedulerConfig
from moelora.lora.pool import AdapterPool, SlotLoads
from tests.helpers.models import engine
from tests.helpers.runs import fake_adapter, prompts, req, run  # noqa: F401  (module fixture)


class LaterLoads(SlotLoads):
    """Runs each write at once but reports it done only from the (polls + 1)-th call of `done`."""

    def __init__(self, polls: int):
        self.polls, self.left, self.waited, self.started = polls, {}, [], 0

    def start(self, write):
        write()
        self.started += 1
        handle = object()
        self.left[handle] = self.polls
        return handle

    def done(self, handle):
        self.left[handle] -= 1
        return self.left[handle] < 0

    def wait(self, handle):
        self.waited.append(handle)


def pool_with(loads, n_slots=2, names=("aa", "bbb", "cccc")):
    writes = []
    pool = AdapterPool(n_slots, 4, lambda name, path: fake_adapter(name, len(name)),
                       lambda slot, ad: writes.append((slot, ad and ad.name)), loads=loads)
    for name in names:
        pool.add(name, "p")
    return pool, writes


def test_ensure_answers_true_only_once_the_write_is_done():
    loads = LaterLoads(polls=2)
    pool, writes = pool_with(loads)
    assert not pool.ensure("aa", set())  # write started (first poll), in flight
    assert writes == [(0, "aa")] or writes == [(1, "aa")]
    assert not pool.ensure("aa", set())  # second poll
    assert pool.ensure("aa", set())  # third poll: done
    assert loads.started == 1  # never written twice


def test_slot_in_flight_or_busy_is_never_a_victim():
    loads = LaterLoads(polls=100)
    pool, writes = pool_with(loads)
    assert not pool.ensure("aa", set())
    assert not pool.ensure("bbb", set())
    # both slots taken: "aa" and "bbb" are loading, so "cccc" finds no slot
    assert not pool.ensure("cccc", set())
    assert loads.started == 2 and {w[1] for w in writes} == {"aa", "bbb"}
    loads.left = dict.fromkeys(loads.left, 0)  # both writes finish
    assert pool.ensure("aa", set()) and pool.ensure("bbb", set())
    # "aa" runs (busy): "cccc" may only take "bbb"'s slot
    slot_bbb = pool.acquire(["bbb"])["bbb"]
    assert not pool.ensure("cccc", {"aa"})
    assert writes[-1] == (slot_bbb, "cccc") and pool.evictions == 1


def test_acquire_orders_the_step_after_a_write_in_flight():
    loads = LaterLoads(polls=100)
    pool, _ = pool_with(loads)
    assert not pool.ensure("aa", set())
    handle = next(iter(loads.left))
    slots = pool.acquire(["aa"])
    assert loads.waited == [handle] and set(slots) == {"aa"}
    # evicting a slot whose write is in flight waits for that write first
    assert not pool.ensure("bbb", set())
    pending = [h for h in loads.left if h is not handle][0]
    pool.acquire(["aa", "cccc"])  # "cccc" takes "bbb"'s slot
    assert pending in loads.waited


def test_a_write_seen_done_is_still_joined_to_the_stream():
    """`done` is a query the stream sanitizer cannot see: the step must still wait on the write's
    event (free once it completed), or the next write of that slot races it in the sanitizer's eyes."""
    loads = LaterLoads(polls=1)
    pool, _ = pool_with(loads)
    assert not pool.ensure("aa", set())
    handle = next(iter(loads.left))
    assert pool.ensure("aa", set())
    assert loads.waited == [handle]


def test_staged_adapter_keeps_each_sites_slot_dtype():
    """Staging for the side stream casts each site to its own slot dtype: the DeepSeek router's
    LoRA slots stay fp32 in a bf16 model (casting everything to bf16 changed routing on the H200)."""
    from moelora.config import ModelConfig
    from moelora.models.registry import model_class
    from tests.helpers.models import random_adapter
    from tests.helpers.oracle import tiny_hf_model

    hf = tiny_hf_model("deepseek_v3", seed=3, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                       first_k_dense_replace=1, num_hidden_layers=2)
    cfg = ModelConfig.from_dict(dict(hf.config.to_dict(), architectures=[type(hf).__name__]))
    model = model_class(cfg)(cfg, max_loras=2, max_rank=8, dtype=torch.bfloat16)
    dtypes = model.lora_site_dtypes()
    assert torch.float32 in dtypes.values() and torch.bfloat16 in dtypes.values()
    adapter = random_adapter(model, 7, 8)
    model.set_lora_slot(0, adapter)
    model.set_lora_slot(1, adapter.staged(dtypes, pin=False))
    for name, buf in model.named_buffers():
        if "lora_" in name:
            assert torch.equal(buf[0], buf[1]) if buf.shape[0] == 2 else torch.equal(buf[:, 0], buf[:, 1]), name


def test_scheduler_admits_others_while_an_adapter_loads():
    ready = {"x": False}
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_loras=2), BlockAllocator(64, 4),
                  adapter_ready=lambda name, busy: ready.get(name, True))
    for r in (req(1, 5, "x"), req(2, 5, None), req(3, 5, "y")):
        s.add(r)
    step = s.schedule()
    assert [r.request_id for r in step.requests] == ["r2", "r3"]
    ready["x"] = True
    step = s.schedule()
    assert "r1" in [r.request_id for r in step.requests]


def test_engine_output_does_not_depend_on_when_writes_finish(setup):  # noqa: F811
    model, adapters = setup
    ps = prompts(6, model.config.vocab_size, seed=5)
    names = ["x", None, "y", "x", None, "y"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = run(engine(model, adapters, async_adapter_loading=False), ps, names, params)
    eng = engine(model, adapters, async_adapter_loading=True)
    eng.pool._loads = LaterLoads(polls=3)
    reqs = [eng.add_request(p, params, a) for p, a in zip(ps, names, strict=True)]
    eng.step()
    first = {r.request_id for r in reqs if r.num_computed > 0}
    assert first == {reqs[1].request_id, reqs[4].request_id}  # base rows ran; adapters still loading
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for r in reqs] == want
    assert torch.equal(torch.tensor([len(r.output_ids) for r in reqs]), torch.full((6,), 8))
