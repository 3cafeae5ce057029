"""The model runner: the one place host lists become device tensors (contract 4).

Shape legend: T tokens in the step, B sequences, MB max blocks per sequence, V vocab.
`prepare(step, slot_of)` builds input ids, positions, the paged `AttnMetadata` and the
`LoRABatch` once per step: `pack` makes the step's host lists (`HostStep`, plain ints: what rank 0 sends
tensor-parallel workers), `unpack` uploads them; `run(...)` executes the model and returns the logits of the rows
that sample (the last computed token of each request that reaches its end this step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.engine.kv_cache import PagedKVCache
from moelora.engine.request import PENDING
from moelora.engine.scheduler import ScheduledStep
from moelora.layers.attention import AttnMetadata, SeqSlice
from moelora.lora.batch import NO_SLOT, LoRABatch
from moelora.upload import upload


@dataclass(frozen=True)
class HostStep:
    """One step's packed host inputs: ids, positions, slot mapping, sequence lengths, query starts, sample
    rows, flat block tables and pending sources (int lists), then the token slots and slot ranks."""

    lists: tuple[list[int], ...]
    slots: list[int]
    slot_ranks: list[int]
    seqs: tuple[SeqSlice, ...]
    max_blocks: int
    max_query_len: int
    sample_index: tuple[int, ...]


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttnMetadata
    lora: LoRABatch | None
    sample_rows: torch.Tensor  # [B_s] rows of the step whose logits are sampled
    sample_index: tuple[int, ...]  # index into step.requests of each sampled row
    host: HostStep | None = None  # what it was built from (tensor parallelism sends it to the workers)


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, device: torch.device, lora_rows: bool = True,
                 row_plan_slots: int = 0, lora_width: bool = True):
        """`lora_rows`: build `LoRABatch.active` (the torch backend's per-slot rows; the Triton
        kernels read only the token slots). `row_plan_slots` > 0 (`EngineConfig.group_lora_rows`, the
        model's slot count): every LoRA batch gets its rows grouped by slot (`LoRABatch.with_row_plan`).
        `lora_width` (`EngineConfig.lora_width_by_batch`): batches carry their adapters' largest rank
        (`LoRABatch.max_rank`), so the kernels tile at it; off: None, the pool's."""
        self.model, self.cache, self.device, self.lora_rows = model, cache, device, lora_rows
        self.row_plan_slots = row_plan_slots
        self.lora_width = lora_width
        self.lora_idle: frozenset = frozenset()  # the engine's idle LoRA sites, carried by every LoRABatch

    def _upload(self, *lists: list[int]) -> list[torch.Tensor]:
        """One host->device copy for all of a step's int vectors (each copy costs ~10 us of launch and
        sync on CUDA; a step has seven of them), returned as int64 views; pinned, so it never waits
        for the step in flight (overlapped scheduling)."""
        flat = upload([v for values in lists for v in values], torch.long, self.device)
        return list(flat.split([len(values) for values in lists]))

    def prepare(self, step: ScheduledStep, slot_of: dict[str, int], slot_ranks: list[int],
                pending: tuple[torch.Tensor, dict] | None = None) -> StepInputs:
        """`pending` (overlapped scheduling): (the previous step's sampled tokens on the device, request
        -> its row there); a position whose token is still PENDING takes its id from that tensor."""
        return self.unpack(self.pack(step, slot_of, slot_ranks, pending), pending)

    def pack(self, step: ScheduledStep, slot_of: dict[str, int], slot_ranks: list[int],
             pending: tuple[torch.Tensor, dict] | None = None) -> HostStep:
        bs = self.cache.block_size
        ids, pos, slots, slot_map, seqs, sample_rows, sample_index = [], [], [], [], [], [], []
        seq_lens, starts, flat_tables = [], [0], []
        max_blocks = max(len(r.block_ids) for r in step.requests)
        pad = [0] * max_blocks
        offset = 0
        for i, (req, n) in enumerate(zip(step.requests, step.num_new, strict=True)):
            start, blocks = req.num_computed, req.block_ids
            end = start + n
            slot = NO_SLOT if req.adapter is None else slot_of[req.adapter]
            if n == 1:  # a decode row: no slices or ranges to build
                ids.append(req.token_at(start))
                pos.append(start)
                slot_map.append(blocks[start // bs] * bs + start % bs)
                slots.append(slot)
            else:
                ids += req.token_slice(start, n)
                pos += range(start, end)
                slot_map += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
                slots += [slot] * n
            seqs.append(SeqSlice(offset, n, end, i))
            seq_lens.append(end)
            offset += n
            starts.append(offset)
            flat_tables += blocks
            if len(blocks) < max_blocks:
                flat_tables += pad[:max_blocks - len(blocks)]
            if end == req.num_tokens:
                sample_rows.append(offset - 1)
                sample_index.append(i)
        src = []
        if pending is not None and PENDING in ids:
            row_of, offset = pending[1], 0
            for req, n in zip(step.requests, step.num_new, strict=True):
                src += [row_of[req] if t == PENDING else -1 for t in ids[offset:offset + n]]
                offset += n
        return HostStep((ids, pos, slot_map, seq_lens, starts, sample_rows, flat_tables, src), slots,
                        list(slot_ranks), tuple(seqs), max_blocks, max(step.num_new), tuple(sample_index))

    def unpack(self, host: HostStep, pending: tuple[torch.Tensor, dict] | None = None) -> StepInputs:
        """The device tensors of `host` (one upload) and its `LoRABatch`."""
        ids_t, pos_t, slot_map_t, seq_lens_t, starts_t, rows_t, tables_t, src_t = self._upload(*host.lists)
        seqs, slots, seq_lens, src = host.seqs, host.slots, host.lists[3], host.lists[7]
        max_blocks = host.max_blocks
        if src and pending is not None:  # device-side: the tokens the previous step sampled, never read back here
            # (a tensor-parallel worker has no `pending`: it receives these ids from rank 0, `parallel/worker.py`)
            ids_t = torch.where(src_t >= 0, pending[0].index_select(0, src_t.clamp(min=0)), ids_t)
        meta = AttnMetadata(
            slot_mapping=slot_map_t, block_tables=tables_t.view(len(seqs), max_blocks).to(torch.int32),
            seq_lens=seq_lens_t.to(torch.int32), query_start=starts_t.to(torch.int32), seqs=tuple(seqs),
            max_seq_len=max(seq_lens), max_query_len=host.max_query_len)
        lora = LoRABatch.build(slots, host.slot_ranks, self.device, self.lora_rows, self.lora_idle, self.lora_width) \
            if any(s != NO_SLOT for s in slots) else None
        if lora is not None and self.row_plan_slots:
            lora = lora.with_row_plan(self.row_plan_slots)
        return StepInputs(ids_t, pos_t, meta, lora, rows_t, host.sample_index, host)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, all_logits: bool = False) -> torch.Tensor:
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.cache.layers, inputs.lora)
        if not all_logits:
            hidden = hidden.index_select(0, inputs.sample_rows)
        return self.model.logits(hidden).float()
