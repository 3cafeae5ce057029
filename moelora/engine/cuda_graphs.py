"""CUDA-graph decode: a LoRA graph per batch-size bucket (and a base graph beside it, below), re-captured
when LoRA sites turn on or a wider adapter arrives, not when the set of active adapters changes.

Shape legend: B bucket size, MB max blocks per sequence, S adapter slots, V vocab.
Every input of a decode step lives in a static buffer of fixed address; a replay copies the
step's values in (contract 4) and pads the bucket with rows on no adapter that read and write a
reserved dummy KV block. In a LoRA graph the LoRA kernels of the sites not idle are captured (rows on
no adapter cost nothing in them), so one graph per bucket serves any mix of the registered adapters.

Idle LoRA sites (`LoRABatch.idle`: no registered adapter has weights there) are captured without their LoRA.
The engine's idle set only shrinks (a site turns on when an adapter with LoRA there is registered);
`capture` again with the new set, or a step whose LoRA batch names another set than the graphs were
captured with, re-captures every bucket (after a device sync: no replay of the old graphs is in
flight when they go).
LoRA width (`EngineConfig.lora_width_by_batch`): the graphs are captured at a LoRA width (`LoRABatch.max_rank`:
the kernels tile at that many rank columns, a power of two >= 16, not at the pool's max_lora_rank), the
registered adapters' largest rank; a replay for a step whose rows' adapters are wider first re-captures at
the wider class (`holds`), so no replay ever drops a rank column. Width None: the pool's, for every step.
Base graphs (`EngineConfig.base_decode_graphs`): a second graph per bucket captured with no LoRA batch
(the model's plain path: no LoRA kernel launched, not even one that would exit at once), in the same
memory pool, replayed by steps whose rows name no adapter (`StepInputs.lora` None, as the eager runner
then runs the plain path too). Captured beside the LoRA graphs, unless every LoRA site is idle (then the
LoRA graphs launch no LoRA either and serve those steps).
Needs the Triton backend: the torch twins loop on the host and cannot be captured.
No garbage collection runs inside a capture: a collected cycle that freed another engine's graphs there
would invalidate it (destroying a graph is not permitted while a stream captures).
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager

import torch

from moelora.engine.config import EngineConfig
from moelora.engine.runner import StepInputs
from moelora.kernels.checks import lora_tile_rank
from moelora.kernels.side_stream import layer_streams
from moelora.layers.attention import AttnMetadata, SeqSlice
from moelora.lora.batch import NO_SLOT, LoRABatch, LoRANeeds, plan_step

log = logging.getLogger(__name__)


@contextmanager
def collection_off():
    """No garbage collection inside a capture: a collected cycle holding another engine's graphs destroys them
    (cudaGraphExecDestroy), which is not permitted while a stream captures and invalidates it. Collects first."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def default_buckets(max_num_seqs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


def graph_reserve(cfg: EngineConfig, vocab: int, activations: int, profile_tokens: int) -> int:
    """Bytes the decode graphs keep for good (their memory pool), which the KV pool leaves free: every
    bucket's logits [B, vocab] fp32, once per graph set (two with `base_decode_graphs` when there are
    LoRA slots: the sets share the pool's activations, not their outputs), and one decode forward's
    activations at the largest bucket, taken as the profile forward's peak (`activations`, at
    `profile_tokens` rows) scaled to max_num_seqs rows; with piecewise graphs (`piecewise_graphs.py`) twice the
    peak scaled to their largest bucket: their pool (one piece's transients) and their static buffers (the
    residual, attention state and output, hidden rows at that many rows). 0 without CUDA graphs."""
    from moelora.engine.piecewise_graphs import piecewise_tokens

    if not cfg.use_cuda_graphs:
        return 0
    sets = 2 if cfg.base_decode_graphs and cfg.has_lora_slots else 1
    logits = sum(set(default_buckets(cfg.max_num_seqs))) * vocab * 4 * sets
    pieces = 2 * activations * min(1.0, piecewise_tokens(cfg) / max(1, profile_tokens))
    return logits + int(activations * min(1.0, cfg.max_num_seqs / max(1, profile_tokens)) + pieces)


class GraphSet:
    """What both graph runners share: the padding of their static per-row inputs (`input_ids`, `positions`,
    `slot_mapping`, `token_slots`, `dummy_slot`: the subclass's), what their graphs hold of LoRA -- the sites
    left out (`lora_idle`) and the width (`lora_width`: None, the pool's) -- and the re-capture a step needs
    when its batch wants more; `capture(lora_idle, lora_width)` is the subclass's."""

    what = "decode graphs"
    lora_idle: frozenset = frozenset()
    lora_width: int | None = None

    def holds(self, max_rank: int | None) -> bool:
        """Whether the graphs serve a step whose rows' adapters reach rank `max_rank` (None: unknown)."""
        return self.lora_width is None or (max_rank is not None and max_rank <= self.lora_width)

    @staticmethod
    def width_class(max_rank: int | None) -> int | None:
        """The width to capture at for adapters up to `max_rank`: its tile width (a power of two >= 16),
        so every rank of one class shares the graphs."""
        return None if max_rank is None else lora_tile_rank(max_rank, None)

    def _pad_rows(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) of the static inputs become padding: token 0 at position 0, no adapter, the dummy KV
        block."""
        self.input_ids[lo:hi].zero_()
        self.positions[lo:hi].zero_()
        self.slot_mapping[lo:hi].fill_(self.dummy_slot)
        self.token_slots[lo:hi].fill_(NO_SLOT)

    def _load_rows(self, inputs: StepInputs) -> tuple[int, int]:
        """A step's n rows into the static inputs (ids, positions, slot mapping, adapter slots), after any
        re-capture the step needs (a capture pads every row) -> (n, its bucket B); rows n..B are the caller's."""
        n = inputs.input_ids.shape[0]
        B = next(b for b in self.buckets if b >= n)
        self.ensure_captured(inputs.lora)
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(inputs.meta.slot_mapping, non_blocking=True)
        if inputs.lora is None:
            self.token_slots[:n].fill_(NO_SLOT)
        else:
            self.token_slots[:n].copy_(inputs.lora.token_slots, non_blocking=True)
        return n, B

    def ensure_captured(self, lora: LoRABatch | None) -> None:
        """Re-capture first when a step's LoRA batch needs sites the graphs left out or a wider LoRA width
        (decided from the step's inputs alone: every tensor-parallel rank decides the same)."""
        if lora is not None and (lora.idle != self.lora_idle or not self.holds(lora.max_rank)):
            why = "LoRA sites turned on" if self.holds(lora.max_rank) else f"LoRA rank {lora.max_rank}"
            width = None if lora.max_rank is None or self.lora_width is None else max(lora.max_rank, self.lora_width)
            self.capture(lora.idle, width)
            log.info("%s: %s re-captured at LoRA width %s (%d buckets, %.2f s)", why, self.what,
                     self.lora_width or "of the pool", len(self.buckets), self.capture_s)


class CudaGraphRunner(GraphSet):
    def __init__(self, model, cache, max_num_seqs: int, max_model_len: int, dummy_block: int, needs: LoRANeeds,
                 base_graphs: bool = False, lora_sites: frozenset = frozenset()):
        """`needs`: the eager runner's (`runner.lora_needs`; the captured forward builds its batch by the
        same `plan_step`). `base_graphs`: also capture graphs without LoRA for steps with no adapter rows;
        `lora_sites`: every LoRA site of the model (when all are idle the LoRA graphs serve those steps)."""
        self.model, self.cache, self.needs = model, cache, needs
        self.buckets = sorted(set(default_buckets(max_num_seqs)))
        self.max_model_len = max_model_len
        self.dummy_slot = dummy_block * cache.block_size
        dev = cache.layers[0][0].device
        B, MB = self.buckets[-1], -(-max_model_len // cache.block_size)
        self.input_ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((B,), self.dummy_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.full((B, MB), dummy_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.token_slots = torch.full((B,), NO_SLOT, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.base_graphs, self.lora_sites = base_graphs, lora_sites
        self.base: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # the graphs without LoRA
        self.replays = self.base_replays = 0
        self.pool = None
        self.captures = 0
        self.capture_s = 0.0  # wall time of the last capture, warm-up included

    def _forward(self, B: int, with_lora: bool = True) -> torch.Tensor:
        meta = AttnMetadata(self.slot_mapping[:B], self.block_tables[:B], self.seq_lens[:B],
                            self.query_start[:B + 1], tuple(SeqSlice(i, 1, 1, i) for i in range(B)),
                            max_seq_len=self.max_model_len, max_query_len=1)
        # inside the capture: every replay groups its own rows
        lora = plan_step(self.token_slots[:B], None, self.lora_width, None, self.needs,
                         self.lora_idle) if with_lora else None
        hidden = self.model(self.input_ids[:B], self.positions[:B], meta, self.cache.layers, lora)
        return self.model.logits(hidden).float()

    @torch.inference_mode()
    def capture(self, lora_idle: frozenset = frozenset(), lora_width: int | None = None) -> None:
        """Capture every bucket (again: the old graphs and their memory pool are released first)
        with `lora_idle` the LoRA sites left out, at LoRA width `lora_width` (rounded to its `width_class`;
        None: the pool's); and, with `base_graphs` while some LoRA site is on, each bucket without LoRA."""
        if self.graphs:
            torch.cuda.synchronize()
            self.graphs.clear()
            self.base.clear()
            self.pool = None
            # the warm-up below runs the forward for real: every row must write the dummy KV block,
            # not the cache slots the last step's sequences left in these buffers
            self._pad(0, self.buckets[-1])
        t0 = time.perf_counter()
        self.lora_idle = lora_idle
        self.lora_width = self.width_class(lora_width)
        self.captures += 1
        sets = [(self.graphs, True)]
        if self.base_graphs and not self.lora_sites <= lora_idle:
            sets.append((self.base, False))
        side = layer_streams(self.input_ids.device).capture  # never a layer's side stream (`layer_streams`)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile kernels, settle allocations
            for _, with_lora in sets:
                for B in self.buckets:
                    self._forward(B, with_lora)
        torch.cuda.current_stream().wait_stream(side)
        with collection_off():
            for graphs, with_lora in sets:  # one pool: a replay at a time, and each step reads its logits first
                for B in reversed(self.buckets):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=side):
                        logits = self._forward(B, with_lora)
                    if self.pool is None:
                        self.pool = graph.pool()
                    graphs[B] = (graph, logits)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def _pad(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) become padding: no adapter, the dummy KV block, context of 1."""
        self._pad_rows(lo, hi)
        self.block_tables[lo:hi, 0].fill_(self.dummy_slot // self.cache.block_size)
        self.seq_lens[lo:hi].fill_(1)

    def graph_for(self, B: int, lora: LoRABatch | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The bucket-B graph (and its logits) a step whose LoRA batch is `lora` replays: the base set's
        when its rows name no adapter and base graphs are captured, else the LoRA set's."""
        return self.base[B] if lora is None and self.base else self.graphs[B]

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.buckets[-1]

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the bucket graph for a decode step (one token per sequence) -> logits [n, V]."""
        n, B = self._load_rows(inputs)
        meta = inputs.meta
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        if n < B:
            self._pad(n, B)
        entry = self.graph_for(B, inputs.lora)
        self.replays += 1
        self.base_replays += entry is self.base.get(B)
        graph, logits = entry
        graph.replay()
        return logits[:n]
