"""The W8A8 twin's error bound against the W8A16 twin, per GEMM, and a hook that checks it at every FP8
layer of a model on the activations the layer actually sees.

e4m3 rounding of an activation x_k with group scale s (amax / 448 of its 128-group, or of its row):
|x_k - q(x_k)| <= 2^-4 |x_k| + 2^-10 s. A linear's base GEMM then errs by at most
  D(x, W) = (2^-4 |x| + 2^-10 s) |W|^T
and LoRA reads x unrounded. Routed experts (gate_up, silu(gate) * up, down), per route on expert e and slot
s: d_gu = D(x, W_gu); with silu's slope in [-0.1, 1.1], h = silu(g) u errs by
  d_h <= 1.1 d_g (|u| + d_u) + |silu(g)| d_u
and the down GEMM, which rounds its own input h' (|h'| <= |h| + d_h) and whose LoRA reads h', by
  d_y <= D(|h| + d_h, W_d) + d_h (|W_d|^T + |A_d|^T |B_d|^T);
the output sums w_tk d_y over the token's routes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moelora.kernels.reference import fused_moe_ref, lora_linear_ref
from moelora.quant.fp8 import ABS_ERROR, REL_ERROR

SLACK = 1e-5  # fp32 sums of the two twins' GEMMs


def gemm_bound(x: torch.Tensor, w: torch.Tensor, group: int | None) -> torch.Tensor:
    """D(x, W) for x [T, K] (or any magnitudes >= |x|), W [N, K] -> [T, N]."""
    x = x.abs()
    g = x.shape[1] if group is None else group
    amax = torch.stack([x[:, i:i + g].amax(1) for i in range(0, x.shape[1], g)], 1)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax)).repeat_interleave(g, 1)[:, :x.shape[1]]
    return (REL_ERROR * x + ABS_ERROR * s) @ w.abs().t()


def experts_bound(x, w_gu, w_d, topk_weights, topk_ids, group, lora_terms=None) -> torch.Tensor:
    """Bound [T, H] of the routed experts' W8A8 error; lora_terms: per token None (no adapter) or, for its
    slot, (|A_d|^T |B_d|^T [E, I, H], the gate_up LoRA delta of x_t [E, 1, 2I])."""
    T, inter = x.shape[0], w_d.shape[2]
    out = torch.zeros(T, w_d.shape[1], dtype=torch.float64, device=x.device)
    x = x.double()
    for t in range(T):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gu = x[t:t + 1] @ w_gu[e].double().t()
            lora = None if lora_terms is None else lora_terms[t]
            if lora is not None:
                gu = gu + lora[1][e]
            d_gu = gemm_bound(x[t:t + 1], w_gu[e].double(), group)
            g, u, d_g, d_u = gu[:, :inter], gu[:, inter:], d_gu[:, :inter], d_gu[:, inter:]
            h = F.silu(g) * u
            d_h = 1.1 * d_g * (u.abs() + d_u) + F.silu(g).abs() * d_u
            w_abs = w_d[e].double().abs()
            if lora is not None:
                w_abs = w_abs + lora[0][e].t()
            d_y = gemm_bound(h.abs() + d_h, w_d[e].double(), group) + d_h @ w_abs.t()
            out[t] += float(topk_weights[t, k]) * d_y[0]
    return out


def _linear_check(module, group, seen):
    def hook(mod, args, output):
        x, lora = args[0], (args[1] if len(args) > 1 else None)
        w = mod.dense_weight(x.dtype)
        exact = lora_linear_ref(x, w, mod.bias, mod.lora_args(lora))
        diff = (output - exact).abs()
        assert torch.all(diff <= gemm_bound(x, w, group).to(diff.dtype) + SLACK), mod
        seen.append(type(mod).__name__)
    return module.register_forward_hook(hook)


def _experts_check(module, group, seen):
    def hook(mod, args, output):
        x, weights, ids, lora = args
        w_gu, w_d = mod.dense_weights(x.dtype)
        lora_args = mod.lora_args(lora)
        exact = fused_moe_ref(x, w_gu, w_d, weights, ids, lora=lora_args)
        terms = None
        if lora_args is not None:
            slots = lora.token_slots.tolist()
            terms = []
            for t, s in enumerate(slots):
                if s < 0:
                    terms.append(None)
                    continue
                a_d, b_d = mod.lora_down_a[s].double().abs(), mod.lora_down_b[s].double().abs()
                ab_down = torch.einsum("eri,ehr->eih", a_d, b_d)
                gu_delta = torch.einsum("k,erk,eor->eo", x[t].double(), mod.lora_gate_up_a[s].double(),
                                        mod.lora_gate_up_b[s].double())[:, None, :]
                terms.append((ab_down, gu_delta))
        bound = experts_bound(x, w_gu, w_d, weights, ids, group, terms)
        diff = (output - exact).abs().double()
        assert torch.all(diff <= bound + SLACK), (diff - bound).max()
        seen.append(type(mod).__name__)
    return module.register_forward_hook(hook)


def check_w8a8_bounds(model) -> list[str]:
    """Hook every FP8 layer of `model` (its config quantizing activations): each call's output must be within
    the bound of the W8A16 twin on the same input. Returns the list the hooks append checked layers to."""
    seen: list[str] = []
    for mod in model.modules():
        cfg = getattr(mod, "quant", None)
        if cfg is None or type(mod).__name__ == "LinearSegment":
            continue
        assert cfg.quantize_activations
        if hasattr(mod, "dense_weights"):
            _experts_check(mod, cfg.activation_group, seen)
        else:
            _linear_check(mod, cfg.activation_group, seen)
    return seen
