"""The argument types of the LoRA and MoE launchers and of their torch twins (torch only, no Triton).

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, R max rank, S adapter slots,
N_in / N_out a linear layer's in / out features, G output segments.
LoRA weights are per-slot stacks, scaling folded into B, zero past a slot's rank r (kernels read r columns);
the twins loop over `active`, built on the host once per step, so they never sync on a tensor value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class SlotRows:
    """Host-side view of one active adapter slot in this step: its rank and its token rows."""

    slot: int
    rank: int
    rows: torch.Tensor  # [n] int64 token indices on the compute device


@dataclass(frozen=True)
class DenseLoRAArgs:
    """LoRA on a linear layer: a [S, R, N_in], b [S, N_out, R]. With `segments` (N_0, .., N_{G-1}) summing to N_out
    (G linears over one input merged, e.g. q/k/v): a [S, G*R, N_in] (segment g's A in rows [gR, gR + R)), b's
    rows [off_g, off_g + N_g) segment g's B (off_g = N_0 + .. + N_{g-1}), slot_ranks [G, S] (per segment)."""

    a: torch.Tensor
    b: torch.Tensor
    token_slots: torch.Tensor  # [T] int32, -1 = no adapter
    slot_ranks: torch.Tensor  # [S] int32, or [G, S] with segments
    active: tuple[SlotRows, ...] | None  # None: for the Triton kernels only (the twins refuse it)
    segments: tuple[int, ...] = ()
    row_plan: MoERoutingPlan | None = None  # the rows grouped by slot (Triton "planned" mode; built if None)
    width: int | None = None  # Triton: a host bound on the rows' slots' ranks (checks.lora_tile_rank); None: R
    slots: torch.Tensor | None = None  # [n] int32: the rows' slots of rank > 0, ascending (`LoRABatch.slots`)


@dataclass(frozen=True)
class ExpertLoRAArgs:
    """LoRA on routed experts, per (slot, expert): gate_up_a [S, E, R, H], gate_up_b [S, E, 2I, R], down_a
    [S, E, R, I], down_b [S, E, H, R]; gate_up_ranks / down_ranks [S] int32, each projection's own (0: none)."""

    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor
    token_slots: torch.Tensor
    gate_up_ranks: torch.Tensor
    down_ranks: torch.Tensor
    active: tuple[SlotRows, ...] | None  # None: for the Triton kernels only (the twins refuse it)
    width: int | None = None  # Triton: a host bound on the rows' slots' ranks (checks.lora_tile_rank); None: R


@dataclass(frozen=True)
class MoERoutingPlan:
    """Contract 3's routing plan, shared by every expert GEMM of one MoE call (`moe_plan`; twin in `reference`).
    Route id r = t * K + k. `sorted_route_ids` [max_padded] int32: each expert's routes in ascending id, padded
    with the sentinel T*K to a multiple of block_m, experts in ascending id, then sentinels; `expert_of_block`
    [max_blocks] int32, -1 past `num_padded` [1] int32. Sizes from T, K, E, block_m only: CUDA-graph safe."""

    sorted_route_ids: torch.Tensor
    expert_of_block: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_tokens: int
    top_k: int
    num_experts: int
    # Under an expert map (expert parallelism: this rank holds some of the experts): [T, K] int32, each
    # route's local expert or -1 for another rank's route, which is in no block (its GEMM rows never exist);
    # num_experts and expert_of_block are then local. None: every route is in the plan, as topk_ids says.
    local_ids: torch.Tensor | None = None

    @property
    def num_routes(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def max_blocks(self) -> int:
        return self.expert_of_block.shape[0]


class FP8Rows(NamedTuple):
    """Rows of a GEMM input already quantized for W8A8 (`fp8_quant.per_token_group_quant`'s output, bit for bit),
    made by the kernel that wrote the input (`norm.norm_fp8`): q [T, K] e4m3, s [T, ceil(K/128)] fp32."""

    q: torch.Tensor
    s: torch.Tensor


FP8_DECODE_BLOCK_N = 64  # `fp8_linear`'s split-K tile width: its split-K counts arrivals once a tile
FP8_SPLIT_K_ROW_TILES = 2  # `fp8_linear` splits K up to 128 rows, in row tiles of 16, 32 or 64 rows: at most 2


def split_k_counters(n_out: int) -> torch.Tensor:
    """`fp8_linear`'s split-K arrival counters for an N_out-wide weight: int32 zeros, one a split-K tile. Each
    FP8 linear layer owns its buffer (a layer's calls never overlap); every call leaves it zero."""
    return torch.zeros(FP8_SPLIT_K_ROW_TILES * -(-n_out // FP8_DECODE_BLOCK_N), dtype=torch.int32)
