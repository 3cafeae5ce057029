"""Continuous-batching scheduler: host-only logic, unit-tested without a GPU.

Each step: running requests first (decodes before prefill chunks), then new requests, within a
token budget (chunked prefill) and `max_num_seqs`. KV blocks are taken as needed; when none are
left, the newest running request is preempted (its blocks freed, recomputed later from its
tokens). A request is admitted only while the distinct adapters of the running set fit the GPU
adapter slots. Among waiting requests, the adapter that has been served the fewest tokens goes
first (arrival order inside an adapter), so one adapter's flood cannot starve another. With an
`adapter_ready(name, running_adapters)` check (the pool's `ensure`), a request whose adapter is
still being copied to its slot waits without holding back the requests behind it. With prefix caching, a request
most of whose uncached prompt blocks a running request is computing right now (n > 1 choices, a burst sharing a
long prefix) waits for them to be published and takes them from the cache (`_wait_for_shared_prefix`).
Policy "priority" (vLLM's `--scheduling-policy priority`): a request's `priority` (lower first) leads every order
above (the adapters' fairness, then arrival, break its ties), and the preemption victim is the running request of
the lowest priority (the newest of them); "fcfs" (default): priority is not read.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from moelora.engine.kv_cache import BlockAllocator, block_hash
from moelora.engine.request import Request, Status
from moelora.errors import CapacityError


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_loras: int = 8
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # or "priority" (module docstring)


@dataclass
class ScheduledStep:
    requests: list[Request]
    num_new: list[int]  # tokens each request computes this step
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: BlockAllocator,
                 adapter_ready: Callable[[str, set[str]], bool] | None = None):
        self.cfg, self.allocator = cfg, allocator
        self.adapter_ready = adapter_ready
        self.block_size = allocator.block_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.served: dict[str | None, int] = defaultdict(int)
        self.held: list[Request] = []  # certain to finish when their pending token is read: not scheduled
        # cumulative counters (vLLM's metrics): preemptions; prefix-cache lookups of admitted requests, in tokens
        # looked up and tokens found
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_steps = 0  # steps scheduled with work, and the tokens the last of them computes
        self.last_step_tokens = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def running_adapters(self) -> set[str]:
        return {r.adapter for r in self.running if r.adapter is not None}

    # blocks -------------------------------------------------------------------------------------
    def _ensure_blocks(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        if need <= 0:  # most decode steps stay inside the last block: no allocator call
            return True
        if need > self.allocator.num_free:
            return False
        for _ in range(need):
            req.block_ids.append(self.allocator.allocate())
        return True

    def free_blocks(self, req: Request) -> None:
        for block in req.block_ids:
            self.allocator.free(block)
        req.block_ids, req.num_cached_blocks, req.block_hashes = [], 0, []

    def _match_prefix(self, req: Request) -> int | None:
        """Reuse cached blocks for the request's leading full blocks (keeping >= 1 token to compute); the hash of
        the first full block not found, or None."""
        if not self.cfg.enable_prefix_caching:
            return None
        ids, missing = req.all_ids, None
        for h in self._chained_hashes(req, ids, 0, (len(ids) - 1) // self.block_size, None):
            block = self.allocator.lookup(h)
            if block is None:
                missing = h
                break
            req.block_ids.append(block)
            req.block_hashes.append(h)
        req.num_cached_blocks = len(req.block_ids)
        req.num_computed = len(req.block_ids) * self.block_size
        return missing

    def _coming_hashes(self, req: Request) -> tuple:
        """The prefix hashes of the full blocks of `req`'s prompt it has not published yet (computed once, from
        its admission; those published since stay in, harmlessly: a lookup finds them cached first)."""
        if req.coming_hashes is None:
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.coming_hashes = tuple(self._chained_hashes(req, req.prompt_ids, len(req.block_hashes),
                                                           len(req.prompt_ids) // self.block_size, parent))
        return req.coming_hashes

    def _chained_hashes(self, req: Request, ids: list[int], first: int, stop: int, parent: int | None):
        """The prefix hashes of `ids`' full blocks first..stop-1, chained on `parent` (block first-1's hash)."""
        bs = self.block_size
        for i in range(first, stop):
            parent = block_hash(req.cache_key, parent, tuple(ids[i * bs:(i + 1) * bs]))
            yield parent

    def _wait_for_shared_prefix(self, req: Request, missing: int, coming: set) -> bool:
        """Whether `req` (its cached prefix matched, `missing` the hash of its first block not cached) should wait a
        step: when at least half of its uncached full blocks are blocks a running request is computing now (n > 1
        choices of one prompt, a burst of prompts with one long shared prefix), it finds them in the cache once
        published instead of computing them again."""
        if missing not in coming:
            return False
        ids, first = req.all_ids, len(req.block_ids)
        full = (len(ids) - 1) // self.block_size - first
        shared = 1  # `missing` itself
        for h in self._chained_hashes(req, ids, first + 1, first + full, missing):
            if h not in coming:
                break
            shared += 1
        return 2 * shared >= full

    def register_computed(self, req: Request) -> None:
        """After a step: publish the request's newly completed full blocks to the prefix cache."""
        if not self.cfg.enable_prefix_caching:
            return
        known = len(req.prompt_ids) + len(req.output_ids)  # pending (unread) tokens cannot be hashed yet
        bs, full = self.block_size, min(req.num_computed, known) // self.block_size
        if full <= req.num_cached_blocks:  # most decode steps: no block completed
            return
        # only the new blocks are hashed, chained on the last published one (was: every block, every step)
        parent = req.block_hashes[-1] if req.block_hashes else None
        for i in range(req.num_cached_blocks, full):
            h = block_hash(req.cache_key, parent, tuple(req.token_slice(i * bs, bs)))
            self.allocator.register(req.block_ids[i], h)
            req.block_hashes.append(h)
            parent = h
        req.num_cached_blocks = full

    # scheduling ---------------------------------------------------------------------------------
    def _rank(self, req: Request) -> int:
        """The request's priority under the "priority" policy (lower first); 0 for every request under "fcfs"."""
        return req.priority if self.cfg.policy == "priority" else 0

    def _preempt_newest(self, step: ScheduledStep) -> Request | None:
        """Preempt the newest running request (of the lowest priority, under "priority")."""
        victim = max(self.running, key=lambda r: (self._rank(r), r.arrival), default=None)
        if victim is None:
            return None
        self.running.remove(victim)
        if victim in step.requests:
            i = step.requests.index(victim)
            del step.requests[i], step.num_new[i]
        self.free_blocks(victim)
        victim.num_computed, victim.status = 0, Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, victim)
        step.preempted.append(victim)
        return victim

    def _schedule_running(self, step: ScheduledStep, budget: int) -> int:
        left = {id(r): r.num_tokens - r.num_computed for r in self.running}  # tokens to compute, once
        order = sorted(self.running, key=lambda r: (left[id(r)] > 1, self._rank(r), r.arrival))
        for req in order:
            if budget <= 0:
                break
            if req.status != Status.RUNNING:  # preempted earlier in this loop (status checks, not list scans:
                continue  # O(1) per request instead of O(running) at 256 requests)
            n = min(left[id(req)], budget)
            while not self._ensure_blocks(req, req.num_computed + n):
                if self._preempt_newest(step) is req:
                    break
            if req.status == Status.RUNNING:
                step.requests.append(req)
                step.num_new.append(n)
                budget -= n
        return budget

    def _next_waiting(self, blocked: set[str | None], waits: set[int]) -> Request | None:
        candidates = [r for r in self.waiting if r.adapter not in blocked and id(r) not in waits]
        if not candidates:
            return None
        preempted = [r for r in candidates if r.num_preemptions > 0]
        if preempted:  # recompute what was preempted before admitting anything new (of its priority or lower)
            first = min(preempted, key=lambda r: (self._rank(r), r.arrival))
            if all(self._rank(first) <= self._rank(r) for r in candidates):
                return first
        return min(candidates, key=lambda r: (self._rank(r), self.served[r.adapter], r.arrival))

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        blocked: set[str | None] = set()
        waits: set[int] = set()  # requests waiting a step for a shared prefix (`_wait_for_shared_prefix`)
        coming: set | None = None  # the hashes of the prompt blocks running requests are computing
        while budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self._next_waiting(blocked, waits)
            if req is None:
                return
            adapters = self.running_adapters()
            if req.adapter is not None and req.adapter not in adapters and len(adapters) >= self.cfg.max_loras:
                blocked.add(req.adapter)
                continue
            if req.adapter is not None and self.adapter_ready is not None and not self.adapter_ready(
                    req.adapter, adapters):
                blocked.add(req.adapter)  # its slot is still being written: admit the others meanwhile
                continue
            missing = self._match_prefix(req)
            if missing is not None and req.num_preemptions == 0:
                if coming is None:  # prompts with blocks not published yet (overlapped scheduling publishes a
                    # step's blocks after the next step is scheduled)
                    coming = {h for r in self.running if r.num_cached_blocks < len(r.prompt_ids) // self.block_size
                              for h in self._coming_hashes(r)}
                if self._wait_for_shared_prefix(req, missing, coming):
                    self.free_blocks(req)
                    req.num_computed = 0
                    waits.add(id(req))
                    continue
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._ensure_blocks(req, req.num_computed + n):
                self.free_blocks(req)
                req.num_computed = 0
                return
            self.waiting.remove(req)
            if self.cfg.enable_prefix_caching:
                self.prefix_queried_tokens += req.num_tokens
                self.prefix_hit_tokens += req.num_computed
            req.num_cached_tokens = req.num_computed
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            req.status = Status.RUNNING
            self.running.append(req)
            step.requests.append(req)
            step.num_new.append(n)
            budget -= n
            req.coming_hashes = None  # its prefix as matched now
            if coming is not None and req.num_cached_blocks < len(req.prompt_ids) // self.block_size:
                coming.update(self._coming_hashes(req))

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep([], [], [])
        budget = self._schedule_running(step, self.cfg.max_num_batched_tokens)
        if not step.preempted:
            self._admit(step, budget)
        for req, n in zip(step.requests, step.num_new, strict=True):
            self.served[req.adapter] += n
        if step.requests:
            self.num_steps += 1
            self.last_step_tokens = step.num_tokens
        if not step.requests and self.waiting and not self.running and not self.held:
            req = self.waiting[0]
            raise CapacityError(f"request {req.request_id} needs {req.num_tokens} tokens of KV cache, more "
                                f"than the whole cache holds ({self.allocator.num_blocks} blocks of "
                                f"{self.block_size})")
        return step

    def hold(self, req: Request) -> None:
        """Overlapped scheduling: `req` finishes by length once its pending token is read; keep its
        blocks but schedule it no more (`finish` releases it)."""
        if req in self.running:
            self.running.remove(req)
            self.held.append(req)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason, req.finished_time = Status.FINISHED, reason, time.monotonic()
        if req in self.held:
            self.held.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.free_blocks(req)
