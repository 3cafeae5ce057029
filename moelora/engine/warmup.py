"""Start-up warm-up: run the forwards and sampler paths a served request can take before the first one
arrives, so that no request waits for a Triton compile (or a first-use cost: CUDA module loads, cuBLAS
handles, pinned buffers, the first replay of a decode graph).

Shape legend: T tokens of a step, B sequences of a step, BS block size, R LoRA tile width.

Triton compiles a kernel once per signature: its constexprs (the launchers pick block sizes from tables
and rules by the step's token count T, the longest query, the batch) and, per integer argument, whether it
is 1 and whether it is divisible by 16. T reaches the kernels as T, T * top_k (routes) and sizes derived
from them, and a step's block tables as their row stride (its longest sequence in blocks). So:
  prefill   for every range of T between two launch-config boundaries (the powers of two, which hold
            every boundary of the fused-MoE tables, the LoRA and attention rules, and the MoE heuristics'
            for power-of-two expert counts), the largest T of each 2-adic class in it (odd, 2 mod 4, 4 mod 8,
            8 mod 16, 0 mod 16): every divisibility pattern of T and of T times any top-k;
  extend    queries of each attention tile class (T <= 16, <= 32, < 256, >= 256) over cached context,
            with block tables of each row-stride class (1 block, a multiple of 16 blocks, neither);
  decode    eager (no graphs): the same token-count classes as rows of one token; with graphs, one
            replay of each bucket, on the base and the LoRA graphs;
  pieces    with piecewise graphs, one prefill of each bucket's size through them, on no adapter and at the
            widest LoRA width they hold;
each with rows on no adapter and rows on an adapter slot at every LoRA tile width up to the widest
registered adapter's; then the sampler's paths (greedy, temperature, top-k/p, seeded, logprobs,
penalties, logit_bias, min_tokens) and the read-back. Torch kernels compile nothing, so on the torch
backend (the CPU) one step of each kind is run.

A launch argument derived from T in a way T's class does not fix (a chunk or block count: `cdiv(T * K, 128)`,
`plan_capacity`) is `do_not_specialize` in its kernel, and a constexpr from one is taken from T's power-of-two
range or from the route count's (T * top_k; the routing plan's): each such range (x, 2x] holds a power-of-two T,
which the warm-up runs (the top of its own range). Not both in one kernel: with a top-k that is not a power of two
the two ranges cut T in different places (DeepSeek's top-6 at 1199 tokens, 60th session).
tests/engine/test_warmup.py draws steps after the warm-up and finds no new specialization. MLA's
expanded attention expands every cached row of a step at once (`forward_rows`), past the token budget: its
extends of 2 tokens over contexts of each row-count class up to CONTEXT_ROWS_COVER rows cover those.

It leaves nothing behind: its requests live only here (no scheduler, no prefix-cache entry), their
blocks are returned and the free list restored to its order, adapter slots are named but the pool is
never asked (no load, no LRU move), graph replay counters and the RNG states are put back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from moelora.engine.readback import ReadBack
from moelora.engine.request import Request, SamplingParams, Status
from moelora.engine.sampler import logprobs_on_device, logprobs_to_host
from moelora.engine.scheduler import ScheduledStep
from moelora.kernels.checks import lora_tile_rank

log = logging.getLogger(__name__)

_WARMUP_ADAPTER = "warmup"  # a name no pool lookup sees: the runner only maps it to slot 0


def token_counts(limit: int, boundaries: list[int] | None = None) -> list[int]:
    """For each range (lo, hi] between consecutive `boundaries` (default: the powers of two) up to
    `limit`: the largest count in it of each 2-adic class (odd, 2, 4, 8 mod 16 and 0 mod 16), ascending."""
    edges = sorted({b for b in (boundaries or _powers_of_two(limit)) if 0 < b < limit} | {0, limit})
    out = set()
    for lo, hi in zip(edges, edges[1:], strict=False):
        for cls in range(5):
            t = next((t for t in range(hi, lo, -1) if _two_adic(t) == cls), None)
            if t is not None:
                out.add(t)
    return sorted(out)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length() + 1)]


def _two_adic(t: int) -> int:
    """0 odd, 1 for 2 mod 4, 2 for 4 mod 8, 3 for 8 mod 16, 4 for a multiple of 16."""
    return min(4, (t & -t).bit_length() - 1)


def lora_widths(engine) -> list[int | None]:
    """The LoRA tile widths a step can run at: every power of two >= 16 up to the widest registered
    adapter's (`lora_width_by_batch`), or the pool's one width; none without registered adapters."""
    rank = engine._registered_rank
    if rank == 0 or not engine.cfg.has_lora_slots:
        return []
    if not engine.cfg.lora_width_by_batch:
        return [engine.cfg.max_lora_rank]
    top = lora_tile_rank(engine.cfg.max_lora_rank, rank)
    return [w for w in _powers_of_two(top) if 16 <= w <= top]


class _Scratch:
    """Requests of the warm-up's own: blocks borrowed from the allocator (returned by `release`)."""

    def __init__(self, engine):
        self.engine, self.alloc = engine, engine.cache.allocator
        self.vocab = engine.model_config.vocab_size
        self.reqs: list[Request] = []

    def blocks_free(self) -> int:
        return len(self.alloc._free)  # never-used blocks only: a cached block is never evicted here

    def request(self, context: int, new: int, adapter: str | None, params: SamplingParams | None = None) -> Request:
        n = context + new
        ids = [(i * 7919 + 13 * len(self.reqs)) % self.vocab for i in range(n)]
        req = Request(f"warmup-{len(self.reqs)}", ids, params or SamplingParams(), adapter, status=Status.RUNNING)
        req.num_computed = context
        req.block_ids = [self.alloc.allocate() for _ in range(-(-n // self.alloc.block_size))]
        self.reqs.append(req)
        return req

    def release(self) -> None:
        for req in self.reqs:
            for block in req.block_ids:
                self.alloc.free(block)
            req.block_ids = []
        self.reqs = []


@contextmanager
def _untouched(engine) -> Iterator[_Scratch]:
    """A scratch space whose every trace is undone on the way out (see the module docstring)."""
    alloc, graphs, pieces = engine.cache.allocator, engine.graphs, engine.pieces
    free_order, used = list(alloc._free), alloc.num_used
    replays = (graphs.replays, graphs.base_replays) if graphs is not None else None
    piece_replays = pieces.replays if pieces is not None else None
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(engine.device) if engine.device.type == "cuda" else None
    scratch = _Scratch(engine)
    try:
        yield scratch
        scratch.release()
        assert alloc.num_used == used and sorted(alloc._free) == sorted(free_order), "warm-up kept a block"
        alloc._free[:] = free_order
    finally:
        scratch.release()
        if replays is not None:
            graphs.replays, graphs.base_replays = replays
        if piece_replays is not None:
            pieces.replays = piece_replays
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, engine.device)


def _step(scratch: _Scratch, seqs: list[tuple[int, int]], width: int | None, graphs: bool = False,
          pieces: bool = False):
    """One forward of sequences (cached context, new tokens), all on no adapter (width None) or on a slot
    of LoRA width `width`, eager or replaying the decode graphs or the piecewise graphs; None (skipped) when the
    cache cannot hold it now. Blocks are freed after."""
    eng = scratch.engine
    need = sum(-(-(c + n) // scratch.alloc.block_size) for c, n in seqs)
    if need > scratch.blocks_free() or max(c + n for c, n in seqs) > eng.cfg.max_model_len:
        return None
    adapter = _WARMUP_ADAPTER if width is not None else None
    reqs = [scratch.request(c, n, adapter) for c, n in seqs]
    step = ScheduledStep(reqs, [n for _, n in seqs], [])
    ranks = [min(width or 0, eng.cfg.max_lora_rank)] * eng.cfg.max_loras  # tiles round it up to `width`
    inputs = eng.runner.prepare(step, {_WARMUP_ADAPTER: 0} if width is not None else {}, ranks)
    logits = eng.graphs.run(inputs) if graphs else eng.pieces.run(inputs) if pieces else eng.runner.run(inputs)
    scratch.release()
    return logits


# one query length per tile class of the attention kernels (default_attention_config: a query tile of 16 up to
# 16 tokens, 32 up to 32, 64 below 256, 128 from 256)
_QUERY_CLASSES = (16, 32, 255, 256)


def _stride_classes(least: int) -> list[int]:
    """Block counts of at least `least` with a block-table row stride of each class: 1, a multiple of 16,
    and neither (Triton specialises the stride on both)."""
    other = next(b for b in range(max(2, least), max(2, least) + 3) if b % 16)
    return ([1] if least <= 1 else []) + [other, -(-least // 16) * 16]


# MLA's expanded attention expands every cached row of a step at once (`forward_rows`): a row count of its own, up to
# the contexts' sum. Its launch configs change at powers of two up to 4096 rows (the dense LoRA policy), none above
CONTEXT_ROWS_COVER = 8192


def _context_rows(cfg, budget: int) -> list[int]:
    """Row counts (cached context + a 2-token extend) of each class in each power-of-two range up to
    CONTEXT_ROWS_COVER (or the longest sequence); above it a row count's class is all that matters."""
    top = min(max(CONTEXT_ROWS_COVER, budget), cfg.max_model_len)
    return [r for r in token_counts(top) if r > 2]


def _split(total: int, longest: int) -> list[tuple[int, int]]:
    """`total` new tokens as prefills of at most `longest` tokens each."""
    return [(0, min(longest, total - i)) for i in range(0, total, longest)]


def _forwards(engine, scratch: _Scratch, widths: list[int | None], small: bool) -> int:
    """Every prefill, extend and decode shape of the module docstring (`small`: one of each kind);
    returns the forwards run."""
    cfg, bs = engine.cfg, engine.cache.block_size
    longest = cfg.max_model_len - 1
    budget = min(cfg.max_num_batched_tokens, longest * cfg.max_num_seqs)
    prefills = [1, min(16, budget)] if small else token_counts(budget)
    queries = [q for q in ((16,) if small else _QUERY_CLASSES) if q <= min(budget, longest)]
    decodes = [1] if small else token_counts(cfg.max_num_seqs)
    runs = 0
    for width in widths:
        for t in prefills:
            runs += _step(scratch, _split(t, longest), width) is not None
        for q in queries:  # under a query of q tokens, block tables of each row-stride class
            for blocks in _stride_classes(-(-q // bs)):
                runs += _step(scratch, [(blocks * bs - q, q)], width) is not None
        if engine.model_config.attention == "mla" and not small:
            for rows in _context_rows(cfg, budget):  # each row count class of the cached rows expanded at once
                runs += _step(scratch, [(rows - 2, 2)], width) is not None
        if engine.graphs is None:
            for b in decodes:
                for blocks in (1, 3, 16):
                    runs += _step(scratch, [(blocks * bs - 1, 1)] * b, width) is not None
    if engine.graphs is not None:  # each bucket's first replay (graph upload) before a request's
        graph_widths = [None] + ([w for w in widths if w is not None and engine.graphs.holds(w)][-1:])
        for width in graph_widths:
            for b in engine.graphs.buckets:
                runs += _step(scratch, [(bs - 1, 1)] * b, width, graphs=True) is not None
    if engine.pieces is not None:  # each bucket's pieces replayed once (their kernels compiled at the capture)
        piece_widths = [None] + ([w for w in widths if w is not None and engine.pieces.holds(w)][-1:])
        for width in piece_widths:
            for t in engine.pieces.buckets:
                runs += _step(scratch, _split(t, longest), width, pieces=True) is not None
    return runs


SAMPLER_PATHS = (
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20),
    SamplingParams(temperature=1.0, seed=0),
    SamplingParams(temperature=0, logprobs=0),
    SamplingParams(temperature=0.5, logprobs=20),
    SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5),
    SamplingParams(temperature=0, logit_bias=((1, 5.0),), min_tokens=2, stop_token_ids=(2,)),
)


def _sampler(engine, scratch: _Scratch) -> None:
    """The sampler's paths on one batch (one row each), alone and together, with logprobs read back."""
    for group in [[p] for p in SAMPLER_PATHS] + [list(SAMPLER_PATHS)]:
        if len(group) > scratch.blocks_free():
            continue
        reqs = [scratch.request(0, 1, None, p) for p in group]
        step = ScheduledStep(reqs, [1] * len(reqs), [])
        for r, p in zip(reqs, group, strict=True):
            if p.seed is not None:
                r.generator = torch.Generator(engine.device).manual_seed(p.seed)
        logits = engine.runner.run(engine.runner.prepare(step, {}, [0] * engine.cfg.max_loras))
        tokens = engine._sample(logits, reqs)
        wants = [p.logprobs for p in group]
        lp = logprobs_on_device(logits, tokens, wants) if any(w is not None for w in wants) else None
        host = ReadBack([tokens, *(lp[2:] if lp else ())]).get()
        if lp:
            logprobs_to_host((*lp[:2], *host[1:]))
        scratch.release()


def warm_up(engine, small: bool | None = None) -> dict:
    """Run the warm-up on `engine` (idle: no request, nothing in flight); returns what it did
    ({"forwards", "seconds"}), also logged. `small`: one shape of each kind (default: on the torch
    backend, which compiles nothing)."""
    if engine.requests or engine._launched is not None:
        raise RuntimeError("warm_up needs an idle engine (it runs before the first request)")
    t0 = time.perf_counter()
    widths = [None, *lora_widths(engine)]
    with _untouched(engine) as scratch:
        runs = _forwards(engine, scratch, widths, engine.cfg.kernel_backend == "torch" if small is None else small)
        _sampler(engine, scratch)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    seconds = time.perf_counter() - t0
    log.info("warm-up: %d forwards (LoRA widths %s) and the sampler's paths in %.1f s", runs,
             [w for w in widths if w is not None] or "none", seconds)
    return {"forwards": runs, "seconds": seconds}
