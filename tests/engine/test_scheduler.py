"""Host-only engine logic: block allocator, prefix cache, scheduler, adapter pool."""

from __future__ import annotations

import pytest

from moelora.engine.kv_cache import BlockAllocator, block_hash
from moelora.engine.request import Request, SamplingParams, Status
from moelora.engine.scheduler import Scheduler, SchedulerConfig
from moelora.errors import AdapterError, CapacityError
from moelora.lora.pool import AdapterPool
from tests.helpers.runs import fake_adapter, req


def test_allocator_counts_and_reuses_cached_blocks():
    a = BlockAllocator(4, 2)
    blocks = [a.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and a.num_free == 0
    with pytest.raises(CapacityError):
        a.allocate()
    a.register(blocks[0], 111)
    a.free(blocks[0])
    a.free(blocks[1])
    assert a.num_free == 2
    assert a.lookup(111) == blocks[0] and a.num_free == 1  # cached block revived, not handed out
    a.free(blocks[0])
    # allocating everything evicts the cached block and forgets its hash
    taken = [a.allocate(), a.allocate()]
    assert set(taken) == {blocks[0], blocks[1]}
    assert a.lookup(111) is None


def test_prefix_cache_is_keyed_by_adapter():
    assert block_hash("a", None, (1, 2)) != block_hash("b", None, (1, 2))
    assert block_hash(None, None, (1, 2)) != block_hash("a", None, (1, 2))
    assert block_hash("a", 5, (1, 2)) != block_hash("a", 6, (1, 2))


def run_step(s: Scheduler):
    step = s.schedule()
    for r, n in zip(step.requests, step.num_new, strict=True):
        r.num_computed += n
        if r.num_computed == r.num_tokens:
            r.output_ids.append(7)
        s.register_computed(r)
    return step


def test_chunked_prefill_and_decode_priority():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), BlockAllocator(64, 4))
    s.add(req(0, 3))
    step = run_step(s)
    assert step.num_new == [3]
    s.add(req(1, 25))
    step = run_step(s)
    # the decode of r0 goes first, r1's prefill is chunked into the remaining budget
    assert [r.request_id for r in step.requests] == ["r0", "r1"] and step.num_new == [1, 9]
    step = run_step(s)
    assert step.num_new == [1, 9]
    assert sum(step.num_new) <= 10


def test_preemption_frees_blocks_and_recomputes():
    alloc = BlockAllocator(6, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False), alloc)
    old, new = req(0, 8), req(1, 11)
    s.add(old)
    s.add(new)
    run_step(s)  # 2 + 3 blocks
    assert alloc.num_free == 1
    for _ in range(4):
        step = run_step(s)
    assert step.preempted or new.num_preemptions > 0
    assert new.status == Status.WAITING and new.block_ids == [] and new.num_computed == 0
    assert old.status == Status.RUNNING


def test_admission_respects_adapter_slots_and_fairness():
    s = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1000, max_loras=2), BlockAllocator(256, 4))
    for i in range(6):
        s.add(req(i, 4, adapter="flood"))
    s.add(req(10, 4, adapter="b", arrival=10))
    s.add(req(11, 4, adapter="c", arrival=11))
    step = s.schedule()
    adapters = {r.adapter for r in step.requests}
    assert len(adapters) <= 2
    assert "b" in adapters  # not starved behind the flood despite arriving last
    assert "c" not in adapters


def test_prefix_hit_skips_cached_tokens():
    alloc = BlockAllocator(64, 4)
    s = Scheduler(SchedulerConfig(), alloc)
    first = req(0, 10, adapter="x")
    first.cache_key = "x#1"
    s.add(first)
    run_step(s)
    s.finish(first, "stop")
    same = Request("again", list(first.prompt_ids), SamplingParams(), "x", arrival=5.0, cache_key="x#1")
    other = Request("other", list(first.prompt_ids), SamplingParams(), "y", arrival=6.0, cache_key="y#2")
    s.add(same)
    s.add(other)
    step = s.schedule()
    got = dict(zip([r.request_id for r in step.requests], step.num_new, strict=True))
    assert got == {"again": 2, "other": 10}


def test_request_larger_than_cache_is_refused():
    s = Scheduler(SchedulerConfig(), BlockAllocator(2, 4))
    s.add(req(0, 20))
    with pytest.raises(CapacityError):
        s.schedule()


def test_pool_slots_lru_pinning_and_zeroing():
    writes, loads = [], []

    def load(name, path):
        loads.append(name)
        if name == "broken":
            raise AdapterError("broken adapter")
        return fake_adapter(name, len(name))

    pool = AdapterPool(2, 2, load, lambda slot, ad: writes.append((slot, ad and ad.name)))
    pool.add("aa", "p")
    pool.add("bbb", "p", pinned=True)
    with pytest.raises(AdapterError):
        pool.add("broken", "p")
    assert pool.names == ["aa", "bbb"]
    slots = pool.acquire(["aa", None, "bbb"])
    assert sorted(slots.values()) == [0, 1]
    assert pool.slot_ranks[slots["aa"]] == 2 and pool.slot_ranks[slots["bbb"]] == 3
    pool.add("cccc", "p")  # CPU cache of 2: "aa" (unpinned, LRU) is dropped from the CPU cache
    slots2 = pool.acquire(["cccc", "bbb"])
    assert slots2["bbb"] == slots["bbb"] and slots2["cccc"] == slots["aa"] and pool.evictions == 1
    n_loads = len(loads)
    pool.acquire(["aa", "cccc"])  # reloads "aa" from disk
    assert len(loads) == n_loads + 1 and pool.loads == 1
    with pytest.raises(CapacityError):
        pool.acquire(["aa", "bbb", "cccc"])
    pool.remove("cccc")
    assert writes[-1][1] is None  # the slot was zeroed


def test_incremental_block_hashes_equal_the_full_chain():
    """register_computed hashes only newly completed blocks; the chain must be what hashing every
    block from the start gives, and a second request with the same tokens must hit every block."""
    bs = 4
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6), BlockAllocator(64, bs))
    r = req(1, 9, "a", max_tokens=20)
    r.cache_key = "a#1"
    s.add(r)
    for _ in range(12):  # chunked prefill (6 + 3), then decode steps across block boundaries
        run_step(s)
    ids, parent, chain = r.all_ids, None, []
    for i in range(r.num_computed // bs):
        parent = block_hash("a#1", parent, tuple(ids[i * bs:(i + 1) * bs]))
        chain.append(parent)
    assert r.block_hashes == chain and r.num_cached_blocks == len(chain) >= 4
    twin = Request("twin", list(ids), SamplingParams(max_tokens=1), "a", cache_key="a#1")
    s._match_prefix(twin)
    assert twin.block_ids == r.block_ids[:len(twin.block_ids)] and len(twin.block_ids) == (len(ids) - 1) // bs


def test_choices_of_one_prompt_compute_it_once():
    """n > 1: four requests of one 41-token prompt arrive together; the first computes it, the others wait a step
    and take its 10 full blocks from the cache (40 of 41 tokens), where each used to compute all 41."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), BlockAllocator(64, 4))
    prompt = list(range(500, 541))
    reqs = [Request(f"c{i}", list(prompt), SamplingParams(max_tokens=4), arrival=0.0) for i in range(4)]
    for r in reqs:
        s.add(r)
    step = run_step(s)
    assert [r.request_id for r in step.requests] == ["c0"] and step.num_new == [41]
    step = run_step(s)
    assert [r.request_id for r in step.requests] == ["c0", "c1", "c2", "c3"] and step.num_new == [1, 1, 1, 1]
    assert s.prefix_hit_tokens == 3 * 40 and s.prefix_queried_tokens == 4 * 41


def test_a_shared_prefix_waits_only_when_it_is_most_of_the_prompt():
    """A prompt whose uncached blocks a running prefill computes for at least half waits a step (and finds them
    cached); one sharing a smaller part goes now; without prefix caching nothing waits; a chunked prefill keeps
    its sibling waiting until the shared blocks are published."""
    base = list(range(1000, 1040))  # 10 blocks of 4
    mostly = Request("mostly", base + list(range(2000, 2016)), SamplingParams(), arrival=1.0)  # 10 of 14 shared
    little = Request("little", base[:8] + list(range(3000, 3040)), SamplingParams(), arrival=2.0)  # 2 of 12
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512), BlockAllocator(128, 4))
    for r in (Request("first", base + [1], SamplingParams(), arrival=0.0), mostly, little):
        s.add(r)
    assert [r.request_id for r in run_step(s).requests] == ["first", "little"]
    step = run_step(s)
    assert dict(zip([r.request_id for r in step.requests], step.num_new, strict=True))["mostly"] == 56 - 40
    off = Scheduler(SchedulerConfig(max_num_batched_tokens=512, enable_prefix_caching=False), BlockAllocator(128, 4))
    for r in (Request("a", base + [1], SamplingParams()), Request("b", base + [2], SamplingParams())):
        off.add(r)
    assert len(run_step(off).requests) == 2
    chunked = Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockAllocator(128, 4))
    a, b = Request("a", base + [1], SamplingParams(), arrival=0.0), Request("b", base + [2], SamplingParams(),
                                                                            arrival=1.0)
    chunked.add(a)
    chunked.add(b)
    for want in (16, 16, 9):  # a's prefill in three chunks while b waits
        step = run_step(chunked)
        assert [r.request_id for r in step.requests] == ["a"] and step.num_new == [want]
    step = run_step(chunked)
    assert [r.request_id for r in step.requests] == ["a", "b"] and step.num_new == [1, 1]


def test_waiting_for_a_shared_prefix_changes_no_token():
    """The engine, greedy: four choices of one prompt and two prompts sharing most of it, over an adapter and the
    base, give the tokens they give with prefix caching off; with it on (steps synchronous or overlapped) the
    siblings take the first's blocks."""
    from tests.helpers.models import build, engine, random_adapter
    from tests.helpers.oracle import tiny_hf_model

    model = build(tiny_hf_model("qwen3_moe", seed=7), max_loras=2, max_rank=8)
    adapters = {"x": random_adapter(model, 20, 6)}
    prompt = list(range(3, 33))
    prompts = [prompt] * 4 + [prompt[:24] + [50, 51, 52], prompt + [60]] * 2
    names = ["x"] * 6 + [None] * 2
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outs, hits = [], []
    for cached, overlapped in ((False, False), (True, False), (True, True)):
        eng = engine(model, adapters, enable_prefix_caching=cached, async_scheduling=overlapped)
        reqs = [eng.add_request(p, params, a) for p, a in zip(prompts, names, strict=True)]
        while eng.has_unfinished():
            eng.step()
        outs.append([r.output_ids for r in reqs])
        hits.append(eng.scheduler.prefix_hit_tokens)
        eng.check_blocks()
    assert outs[0] == outs[1] == outs[2]
    # blocks of 4: the three other choices 7 blocks each; on "x" the 27-token prompt its 6 blocks, the 31-token one
    # 7; on the base (its own prefixes) the 31-token prompt the 6 blocks the 27-token one computes; overlapped
    # scheduling too (a step's blocks are published after the next step is scheduled: one more step of waiting)
    assert hits == [0, 3 * 28 + 24 + 28 + 24, 3 * 28 + 24 + 28 + 24]


def prioritized(i: int, n: int, priority: int, arrival=None) -> Request:
    r = req(i, n, arrival=arrival)
    r.priority = priority
    return r


def test_priority_policy_orders_admission_and_picks_the_victim():
    """--scheduling-policy priority: the waiting queue by (priority, arrival), lower first; under block pressure the
    lowest-priority running request (the newest of them) is preempted, not the newest one. fcfs reads no priority."""
    def admitted(policy):
        s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=1000, policy=policy),
                      BlockAllocator(256, 4))
        for i, p in enumerate((5, 0, 5, -1)):
            s.add(prioritized(i, 4, p))
        return [r.request_id for r in s.schedule().requests]

    assert admitted("priority") == ["r3", "r1"]  # priorities -1 then 0, whatever their arrival
    assert admitted("fcfs") == ["r0", "r1"]

    def victim(policy):
        alloc = BlockAllocator(6, 4)
        s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False,
                                      policy=policy), alloc)
        urgent_new, relaxed_old = prioritized(1, 11, 0), prioritized(0, 8, 9)
        s.add(relaxed_old)
        s.add(urgent_new)
        preempted = []
        for _ in range(5):
            preempted += run_step(s).preempted
        return [r.request_id for r in preempted][:1]

    assert victim("priority") == ["r0"]  # the old request of priority 9 gives way
    assert victim("fcfs") == ["r1"]  # the newest, as ever


def test_a_preempted_request_waits_behind_a_more_urgent_new_one():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1000, policy="priority"),
                  BlockAllocator(256, 4))
    back = prioritized(0, 4, 3)
    back.num_preemptions = 1  # preempted earlier: first among its equals, not before more urgent ones
    s.add(back)
    s.add(prioritized(1, 4, 0))
    assert [r.request_id for r in s.schedule().requests] == ["r1"]
