"""Fused MoE kernel cases: tiny launch configs per registered LoRA path, random inputs with NaN past
every slot's rank (shared by the bf16/fp16 and the FP8 fused MoE tests)."""

from __future__ import annotations

from dataclasses import replace

import torch

from moelora.kernels.args import ExpertLoRAArgs, SlotRows
from moelora.kernels.moe_config import FusedMoEConfig, GemmTile
from moelora.kernels.moe_lora import PATHS, SeparateConfig

TINY = GemmTile(32, 32, 4, 2)


def tiny_lora(path: str):
    """A registered path's default config with 32-deep shrink steps (tiny shapes span several), and for
    "spread" 16 activation columns a program (so the down shrink has several partials at I = 24..40)."""
    cfg = PATHS[path].config()
    small = {"block_k": 32, "overflow": SeparateConfig(block_k=32), "block_n": 16 if path == "spread" else None}
    return replace(cfg, **{k: v for k, v in small.items() if v is not None and hasattr(cfg, k)})


def tiny_config(shrink="separate", tma=False, bm=16):
    """Tiny tiles on one LoRA path (default: "separate", the path of `default_fused_moe_config`)."""
    return FusedMoEConfig(bm, TINY, TINY, use_tma=tma, lora=tiny_lora(shrink))


def make_case(T, H, inter, E, K, *, ranks=(), R=0, dtype=torch.float32, device="cpu", seed=0,
              slots=None, one_expert=None):
    """Random MoE inputs (never zeros). ranks: per-slot rank (0 = empty slot); slots: token slots."""
    g = torch.Generator().manual_seed(seed)  # routing and slots
    gd = torch.Generator(device=device).manual_seed(seed)  # tensors, drawn where they live

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gd, device=device) * scale).to(dtype)

    x = rn(T, H)
    w_gu, w_d = rn(E, 2 * inter, H, scale=H ** -0.5), rn(E, H, inter, scale=inter ** -0.5)
    if one_expert is not None:
        ids = torch.full((T, K), one_expert, dtype=torch.int64)
    else:
        ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    wts = (torch.rand(T, K, generator=g) + 0.1).to(dtype).to(device)
    lora = None
    if ranks:
        S = len(ranks)
        ga, gb = rn(S, E, R, H, scale=H ** -0.5), rn(S, E, 2 * inter, R, scale=R ** -0.5)
        da, db = rn(S, E, R, inter, scale=inter ** -0.5), rn(S, E, H, R, scale=R ** -0.5)
        for s, r in enumerate(ranks):  # NaN beyond a slot's rank: no path may use those columns
            for t in (ga[s, :, r:], gb[s, :, :, r:], da[s, :, r:], db[s, :, :, r:]):
                t.fill_(float("nan"))
        if slots is None:
            slots = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
        slots = torch.as_tensor(slots, dtype=torch.int32)
        active = tuple(SlotRows(s, ranks[s], (slots == s).nonzero().squeeze(1).to(device))
                       for s in range(S) if ranks[s] > 0 and bool((slots == s).any()))
        site_ranks = torch.tensor(ranks, dtype=torch.int32, device=device)
        lora = ExpertLoRAArgs(ga, gb, da, db, slots.to(device), site_ranks, site_ranks.clone(), active)
    return x, w_gu, w_d, wts, ids.to(device), lora

