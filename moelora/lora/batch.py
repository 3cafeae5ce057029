"""`LoRABatch`: the step's token -> adapter-slot plan, built once per step, read by every layer.

Shape legend: T tokens in the step, S adapter slots.

Contract 4: the host lists are turned into device tensors here, once per step; layers only read
them. `token_slots[t]` is the slot of token t or -1 for the base model (no slot, no compute).
`active` lists, for the torch backend, each slot present in the step with its rank and its token
rows, so the torch path never branches on a tensor value; it is None in a batch built for the
Triton kernels only (`build(..., rows=False)`: they read `token_slots`), and the torch twins refuse
such a batch rather than compute without LoRA.

`build` takes each slot's adapter-level rank (its largest site rank) as host ints: slots of rank 0
are left out of `active`, and `active` carries that rank for the torch twins (exact, because a
slot's weights are zero beyond each site's own rank). No per-slot rank goes to the device here:
every LoRA site owns its own `lora_ranks [S]` device buffer (written when a slot is loaded, 0
where the adapter does not cover the site), which is what its kernels read, so a site an adapter
skips costs no LoRA work.

`row_plan` (`EngineConfig.group_lora_rows`, Triton backend): the step's rows grouped by slot, built by
`plan_step` (one launch on the device, inside the captured graph for decode) when the dense LoRA policy
may take its "planned" mode at this many rows (`LoRANeeds.policy.wants_row_plan`: a program per block of
one slot's rows, where it measured faster); every dense LoRA site reads it.

`side_stream` (`EngineConfig.overlap_lora`, CUDA): the runner's LoRA side stream, on which the Triton LoRA
work that may overlap the base GEMM runs (the dense shrink, the routed experts' down delta); None: one
stream. A runtime resource, so it travels with the step's batch, not in the layers' options.

`idle` (the engine's, when `EngineConfig.skip_idle_lora_sites`): the LoRA modules at which no
registered adapter has weights (every slot's rank 0 there, so their delta is exactly zero). A layer
whose module is in it skips LoRA altogether (`skips`): no kernel launches, not even ones that would
exit at once.

`slots` (eager steps): the slots the rows name with an adapter of rank > 0, ascending, on the device (from the
same copy as `token_slots`), so a kernel can lay out one lane per slot of the step (dense LoRA's "concat"
mode) knowing their number on the host; None in the graph runner's batches.

`max_rank` (`build`): the largest adapter-level rank among the slots the rows name, a host int, so
the Triton kernels tile at that width rather than the pool's (`kernels.checks.lora_tile_rank`): a
batch of rank-8 adapters in a rank-64 pool runs rank-8 tiles, buffers and stacked columns. It is a
bound on every site's rank of those slots (the pool's `slot_ranks`), so the narrower tiles drop
nothing. None: the pool's width (`EngineConfig.lora_width_by_batch` off). The graph runner's captured
batches carry the registered adapters' width class instead (`CudaGraphRunner.lora_width`), since the
slots their replays will name are not known at capture; a wider step re-captures first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moelora.kernels.args import MoERoutingPlan, SlotRows
from moelora.kernels.dense_policy import DENSE_LORA_POLICY, PLAN_BLOCK_M, DenseLoRAPolicy
from moelora.upload import upload

NO_SLOT = -1


@dataclass(frozen=True)
class LoRANeeds:
    """What a model's LoRA paths need in each step's `LoRABatch`, fixed for a runner (both runners of an
    engine hold the same one): `rows`, the torch twins' per-slot rows (`active`); `width`, the rows'
    adapters' largest rank (`EngineConfig.lora_width_by_batch`); `group_slots` > 0, the rows grouped by slot
    over that many slots wherever `policy` may take "planned" (`EngineConfig.group_lora_rows`, Triton);
    `side_stream`, the LoRA side stream (`EngineConfig.overlap_lora`, CUDA); `pdl`, that grouping's launch with
    programmatic dependent launch where the GPU has it (`EngineConfig.pdl`, CUDA; `kernels.pdl`)."""

    rows: bool = True
    width: bool = True
    group_slots: int = 0
    policy: DenseLoRAPolicy = DENSE_LORA_POLICY
    side_stream: torch.cuda.Stream | None = None
    pdl: bool = False


@dataclass(frozen=True)
class LoRABatch:
    token_slots: torch.Tensor  # [T] int32, NO_SLOT = base model
    active: tuple[SlotRows, ...] | None
    idle: frozenset = frozenset()  # LoRA modules no registered adapter has weights at
    row_plan: MoERoutingPlan | None = None  # the rows grouped by slot (a routing plan over the model's slots)
    max_rank: int | None = None  # the rows' slots' largest adapter rank (host); None: the pool's width
    side_stream: torch.cuda.Stream | None = None  # the runner's LoRA side stream (None: one stream)
    slots: torch.Tensor | None = None  # [n] int32: the slots the rows name with rank > 0, ascending (eager steps)

    def skips(self, module) -> bool:
        """Whether `module` (the module owning a site's slot buffers) has no LoRA work in this batch."""
        return module in self.idle

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @staticmethod
    def build(token_slots: Sequence[int], slot_ranks: Sequence[int], device: torch.device | str, rows: bool = True,
              idle: frozenset = frozenset(), width: bool = True) -> LoRABatch:
        """Plan for tokens whose slots are `token_slots` (host ints) given per-slot ranks; `rows`
        False leaves `active` None (the Triton backend never reads it: one copy and loop less); `width`
        False leaves `max_rank` None (the pool's width: `EngineConfig.lora_width_by_batch` off)."""
        return plan_step(*upload_slots(token_slots, slot_ranks, device, rows), LoRANeeds(rows, width), idle)


def upload_slots(token_slots: Sequence[int], slot_ranks: Sequence[int], device: torch.device | str,
                 rows: bool = True) -> tuple[torch.Tensor, tuple[SlotRows, ...] | None, int, torch.Tensor]:
    """An eager step's slots on the device, its per-slot rows (`active`; None when not `rows`), the largest
    adapter rank among the slots its rows name (0: none), and those slots of rank > 0 ascending on the device
    (`LoRABatch.slots`; one copy with the token slots)."""
    named = set(token_slots) - {NO_SLOT}
    bad = [s for s in named if not 0 <= s < len(slot_ranks)]
    if bad:
        raise ValueError(f"tokens name slot {bad[0]}, but there are {len(slot_ranks)} slots")
    max_rank = max((int(slot_ranks[s]) for s in named), default=0)
    live_slots = sorted(s for s in named if slot_ranks[s] > 0)
    both = upload(list(token_slots) + live_slots, torch.int32, device)
    token_slots_t, slots_t = both[:len(token_slots)], both[len(token_slots):]
    if not rows:
        return token_slots_t, None, max_rank, slots_t
    by_slot: dict[int, list[int]] = {}
    for t, s in enumerate(token_slots):
        if s != NO_SLOT:
            by_slot.setdefault(s, []).append(t)
    live = [(s, r) for s, r in sorted(by_slot.items()) if slot_ranks[s] > 0]
    # every slot's row list in one host-to-device copy (one per slot cost ~10 us each on CUDA), then views
    flat = upload([t for _, r in live for t in r], torch.long, device)
    active = tuple(SlotRows(slot=s, rank=int(slot_ranks[s]), rows=part)
                   for (s, _), part in zip(live, flat.split([len(r) for _, r in live]), strict=True))
    return token_slots_t, active, max_rank, slots_t


def plan_step(token_slots: torch.Tensor, active: tuple[SlotRows, ...] | None, max_rank: int | None,
              slots: torch.Tensor | None, needs: LoRANeeds, idle: frozenset = frozenset()) -> LoRABatch:
    """A step's `LoRABatch`, the one builder of both runners: the eager runner's from `upload_slots`, the
    graph runner's inside each captured forward from its static slot buffer (`active` and `slots` None,
    `max_rank` its capture width), so every replay regroups its own rows. It carries the `idle` sites, the width
    (`max_rank`, None unless `needs.width`), the side stream, and the rows grouped by slot when `needs` asks
    for them at this many rows (one launch on the device, never a host sync)."""
    plan = None
    if needs.group_slots and needs.policy.wants_row_plan(token_slots.shape[0]):
        from moelora.kernels.dense_lora.planned import row_plan  # the Triton launch: only on that path

        plan = row_plan(token_slots, needs.group_slots, PLAN_BLOCK_M, pdl=needs.pdl)
    return LoRABatch(token_slots, active, idle, plan, max_rank if needs.width else None, needs.side_stream, slots)
