"""Torch twins of every kernel launcher: the semantics the Triton kernels must reproduce.

These are also the `kernel_backend="torch"` implementation (CPU, and the GPU reference).
Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, R max rank,
S adapter slots, N_in / N_out a linear layer's in / out features.

LoRA arguments (`DenseLoRAArgs`, `ExpertLoRAArgs`) carry per-slot stacked weights with the
scaling already folded into B, the per-token slot (-1: no adapter) and per-slot rank. A slot of
rank r < R has zeros beyond column r of A/B; kernels read only the first r columns. The torch
twins loop over `active` (slot, rows) pairs that the step's `LoRABatch` built on the host once
per step, so they never sync on a tensor value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SlotRows:
    """Host-side view of one active adapter slot in this step: its rank and its token rows."""

    slot: int
    rank: int
    rows: torch.Tensor  # [n] int64 token indices on the compute device


@dataclass(frozen=True)
class DenseLoRAArgs:
    """LoRA on a linear layer: a [S, R, N_in], b [S, N_out, R] (scaling folded into b)."""

    a: torch.Tensor
    b: torch.Tensor
    token_slots: torch.Tensor  # [T] int32, -1 = no adapter
    slot_ranks: torch.Tensor  # [S] int32
    active: tuple[SlotRows, ...]


@dataclass(frozen=True)
class ExpertLoRAArgs:
    """LoRA on routed experts, per (slot, expert):
    gate_up_a [S, E, R, H], gate_up_b [S, E, 2I, R], down_a [S, E, R, I], down_b [S, E, H, R]."""

    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor
    token_slots: torch.Tensor
    slot_ranks: torch.Tensor
    active: tuple[SlotRows, ...]


def lora_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    lora: DenseLoRAArgs | None) -> torch.Tensor:
    """y = x @ W^T + bias + (x @ A_s^T @ B_s^T for rows on slot s). x [T, N_in] -> [T, N_out]."""
    y = F.linear(x, weight, bias)
    if lora is None:
        return y
    for sr in lora.active:
        xa = x.index_select(0, sr.rows) @ lora.a[sr.slot, : sr.rank].to(x.dtype).t()
        delta = xa @ lora.b[sr.slot, :, : sr.rank].to(x.dtype).t()
        y = y.index_add(0, sr.rows, delta)
    return y


def _expert_delta(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rank: int) -> torch.Tensor:
    return (h @ a[:rank].to(h.dtype).t()) @ b[:, :rank].to(h.dtype).t()


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  lora: ExpertLoRAArgs | None = None) -> torch.Tensor:
    """Routed experts with optional per-token LoRA. x [T, H], w_gate_up [E, 2I, H],
    w_down [E, H, I], topk_weights [T, K] (applied after the down projection, in fp32),
    topk_ids [T, K] -> out [T, H] (a new tensor; x is never written).

    For route (t, k) on expert e with token slot s:
      gu = x_t W_gu[e]^T + (x_t A_gu[s,e]^T) B_gu[s,e]^T;  h = silu(gu[:I]) * gu[I:]
      y  = h W_d[e]^T + (h A_d[s,e]^T) B_d[s,e]^T;         out_t += w_tk * y
    Loops over experts on the host with index lists: correct everywhere, syncs on CUDA (the
    Triton path is the graph-safe one).
    """
    T, H = x.shape
    inter = w_down.shape[2]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    slot_of_row = None
    if lora is not None:
        slot_of_row = torch.full((T,), -1, dtype=torch.long, device=x.device)
        for sr in lora.active:
            slot_of_row[sr.rows] = sr.slot
        ranks = {sr.slot: sr.rank for sr in lora.active}
    flat_ids = topk_ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        route = (flat_ids == e).nonzero().squeeze(1)
        tok = route // topk_ids.shape[1]
        xe = x.index_select(0, tok)
        gu = xe @ w_gate_up[e].t()
        if slot_of_row is not None:
            gu = gu.clone()
            slots = slot_of_row.index_select(0, tok)
            for s in torch.unique(slots).tolist():
                if s < 0:
                    continue
                sel = (slots == s).nonzero().squeeze(1)
                gu[sel] += _expert_delta(xe[sel], lora.gate_up_a[s, e], lora.gate_up_b[s, e], ranks[s])
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = h @ w_down[e].t()
        if slot_of_row is not None:
            for s in torch.unique(slots).tolist():
                if s < 0:
                    continue
                sel = (slots == s).nonzero().squeeze(1)
                y[sel] += _expert_delta(h[sel], lora.down_a[s, e], lora.down_b[s, e], ranks[s])
        w = topk_weights.reshape(-1).index_select(0, route).to(torch.float32)
        out.index_add_(0, tok, y.to(torch.float32) * w[:, None])
    return out.to(x.dtype)
