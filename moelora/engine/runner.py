"""The model runner: the one place host lists become device tensors (contract 4).

Shape legend: T tokens in the step, B sequences, MB max blocks per sequence, V vocab.
`prepare(step, slot_of)` builds input ids, positions, the paged `AttnMetadata` and the
`LoRABatch` once per step: `pack` makes the step's host lists (`HostStep`, plain ints: what rank 0 sends
tensor-parallel workers), `unpack` uploads them (the `LoRABatch` by `lora.batch.plan_step`, as the decode
graphs build theirs); `run(...)` executes the model and returns the logits of the rows
that sample (the last computed token of each request that reaches its end this step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.engine.config import EngineConfig
from moelora.engine.kv_cache import PagedKVCache
from moelora.engine.request import PENDING
from moelora.engine.scheduler import ScheduledStep
from moelora.kernels.side_stream import lora_stream
from moelora.layers.attention import AttnMetadata, SeqSlice
from moelora.lora.batch import NO_SLOT, LoRABatch, LoRANeeds, plan_step, upload_slots
from moelora.upload import upload

LOGIT_CHUNK_BYTES = 1 << 28  # 256 MiB: 441 rows of a 152k vocabulary (Qwen3), 655 of DeepSeek's 102k


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


def lora_needs(cfg: EngineConfig, model) -> LoRANeeds:
    """What `model`'s LoRA paths need in every step's batch under `cfg` (resolved), for both runners: the
    torch twins' per-slot rows, the width, the rows grouped by slot over the model's slots (Triton, as its
    dense policy wants them), a LoRA side stream (a new CUDA stream: this runner's, `overlap_lora`) and the
    model's `pdl` (its layer options', as `cfg.layer_options` set them)."""
    device = cfg.torch_device
    triton = cfg.kernel_backend == "triton"
    return LoRANeeds(rows=not triton, width=cfg.lora_width_by_batch,
                     group_slots=model.max_loras if cfg.group_lora_rows and triton else 0,
                     policy=model.options.dense_lora_policy,
                     side_stream=lora_stream(device) if cfg.overlap_lora and device.type == "cuda" else None,
                     pdl=model.options.pdl)


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, device: torch.device, needs: LoRANeeds | None = None):
        """`needs`: what every step's `LoRABatch` carries (`lora_needs`; None: the twins' rows and the width)."""
        self.model, self.cache, self.device, self.needs = model, cache, device, needs or LoRANeeds()
        self.lora_idle: frozenset = frozenset()  # the engine's idle LoRA sites, carried by every LoRABatch
        # rows of logits made at once when every row's are asked for (prompt scoring): ~LOGIT_CHUNK_BYTES of fp32
        self.logit_rows = max(1, LOGIT_CHUNK_BYTES // (4 * model.config.vocab_size))

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
        lora = None
        if any(s != NO_SLOT for s in slots):
            lora = plan_step(*upload_slots(slots, host.slot_ranks, self.device, self.needs.rows), self.needs,
                             self.lora_idle)
        return StepInputs(ids_t, pos_t, meta, lora, rows_t, host.sample_index, host)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, all_logits: bool = False, rows_fn=None) -> torch.Tensor | None:
        """The fp32 logits of the sample rows; with `all_logits` of every row, made `logit_rows` rows at a time
        (the same on every tensor-parallel rank: each is a collective there) and handed to `rows_fn(first row,
        logits)` one chunk after the other (then None is returned), or written into one [T, V] tensor."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.cache.layers, inputs.lora)
        if not all_logits:
            return self.model.logits(hidden.index_select(0, inputs.sample_rows)).float()
        return self.all_logits(hidden, rows_fn)

    @torch.inference_mode()
    def all_logits(self, hidden: torch.Tensor, rows_fn=None) -> torch.Tensor | None:
        """Every row's fp32 logits, `logit_rows` rows at a time, as `run(all_logits=True)` makes them."""
        step = self.logit_rows
        out = None
        for r0 in range(0, hidden.shape[0], step):
            logits = self.model.logits(hidden[r0:r0 + step]).float()
            if rows_fn is not None:
                rows_fn(r0, logits)
                continue
            if out is None:
                out = logits.new_empty(hidden.shape[0], logits.shape[1])
            out[r0:r0 + logits.shape[0]] = logits
        return out
