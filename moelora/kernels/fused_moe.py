"""Fused routed-expert MoE with per-token multi-LoRA: the base pipeline over the kernels of moe_gemm.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k.
  x [T, H], w_gate_up [E, 2I, H] (gate rows then up rows), w_down [E, H, I], topk_weights [T, K] (float),
  topk_ids [T, K] (int32/int64), lora: ExpertLoRAArgs                                  -> out [T, H]
plan -> gate_up + SiLU*up -> down x routing weight -> combine: fixed sizes, no host sync, deterministic;
the routed LoRA is a `moe_lora` path's hooks. Inputs are never written (contract 2).
"""

from __future__ import annotations

import os

import torch

from moelora.kernels.args import ExpertLoRAArgs, FP8Rows, MoERoutingPlan
from moelora.kernels.checks import FLOAT_DTYPES, cdiv, lora_tile_rank, need, next_pow2, output
from moelora.kernels.fp8_moe import FP8_DTYPE, FP8ExpertScales, check_fp8, fp8_launch_args, fp8_moe_config
from moelora.kernels.moe_config import FusedMoEConfig, lora_paths, tuned_fused_moe_config
from moelora.kernels.moe_gemm import combine_kernel, down_kernel, gate_up_kernel
from moelora.kernels.moe_lora.base import MoECall, MoELoRAPath
from moelora.kernels.moe_plan import build_routing_plan, per_route_plan
from moelora.kernels.pdl import pdl_args

GROUP_M = 8  # grouped tile order of both GEMMs: every tuned entry kept 8 (docs/performance.md, tried and removed)


def _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids):
    need(x.dim() == 2 and x.dtype in FLOAT_DTYPES, lambda: f"x must be [T, H] fp16/bf16/fp32, got "
         f"{tuple(x.shape)} {x.dtype}")
    T, H = x.shape
    need(w_gate_up.dim() == 3 and w_gate_up.shape[2] == H and w_gate_up.shape[1] % 2 == 0,
         lambda: f"w_gate_up must be [E, 2I, H={H}], got {tuple(w_gate_up.shape)}")
    E, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    need(tuple(w_down.shape) == (E, H, inter),
         lambda: f"w_down must be [E={E}, H={H}, I={inter}], got {tuple(w_down.shape)}")
    need(topk_ids.dim() == 2 and topk_ids.shape[0] == T and topk_ids.dtype in (torch.int32, torch.int64),
         lambda: f"topk_ids must be [T={T}, K] int32/int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    need(topk_weights.shape == topk_ids.shape and topk_weights.is_floating_point(),
         lambda: f"topk_weights must be float {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        need(t.dtype in (x.dtype, FP8_DTYPE) and t.dtype == w_gate_up.dtype,
             lambda t=t, name=name: f"{name} dtype {t.dtype} must be x's ({x.dtype}), or float8_e4m3fn for both "
             "weights")
        need(t.is_contiguous(), lambda name=name: f"{name} must be contiguous")
    need(x.stride(1) == 1, "x must have unit stride in its last dim")
    for t in (w_gate_up, w_down, topk_weights, topk_ids):
        need(t.device == x.device, lambda: f"all inputs must be on {x.device}")
    return T, H, E, inter, topk_ids.shape[1]


def _check_lora(lora: ExpertLoRAArgs, T, H, E, inter):
    S, _, R, _ = lora.gate_up_a.shape
    want = {"gate_up_a": (S, E, R, H), "gate_up_b": (S, E, 2 * inter, R), "down_a": (S, E, R, inter),
            "down_b": (S, E, H, R)}
    for name, shape in want.items():
        t = getattr(lora, name)
        if tuple(t.shape) != shape:
            raise ValueError(f"lora.{name} must be {shape}, got {tuple(t.shape)}")
        if not (t.stride(-1) == 1 and t.is_floating_point()):
            raise ValueError(f"lora.{name} must be float, unit last stride")
        if name.endswith("_b") and not (t.shape[2] <= 1 or t.stride(2) == R):  # B tiles read whole 16-column chunks
            raise ValueError(f"lora.{name} must have rows of R={R} contiguous columns, got row stride {t.stride(2)}")
    need(tuple(lora.token_slots.shape) == (T,) and lora.token_slots.dtype == torch.int32,
         lambda: f"lora.token_slots must be [T={T}] int32, got {tuple(lora.token_slots.shape)} "
         f"{lora.token_slots.dtype}")
    for name in ("gate_up_ranks", "down_ranks"):
        t = getattr(lora, name)
        if not (tuple(t.shape) == (S,) and t.dtype == torch.int32 and t.is_contiguous()):
            raise ValueError(f"lora.{name} must be contiguous [S={S}] int32, got {tuple(t.shape)} {t.dtype}")
    return lora_tile_rank(R, lora.width)


def _check_tma(x, H, inter, cfg: FusedMoEConfig):
    if not cfg.use_tma:
        return
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter emulates the descriptors
    if not (interpreted or x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9):
        raise ValueError("use_tma=True needs a CUDA GPU of compute capability >= 9.0 (Hopper)")
    if (H * x.element_size()) % 16 or (inter * x.element_size()) % 16:
        raise ValueError(f"use_tma=True needs 16-byte rows: H={H}, I={inter} in {x.dtype}")


def _tma_operands(w_gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor, config: FusedMoEConfig):
    """Hopper tensor descriptors of the weight tiles and of the down GEMM's activation tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, two_i, H = w_gate_up.shape
    gu, dn = config.gate_up, config.down
    return (TensorDescriptor.from_tensor(w_gate_up.view(E * two_i, H), [gu.block_n, gu.block_k]),
            TensorDescriptor.from_tensor(w_down.view(E * H, two_i // 2), [dn.block_n, dn.block_k]),
            TensorDescriptor.from_tensor(h, [config.block_m, dn.block_k]))


def lora_path(lora: ExpertLoRAArgs | None, config: FusedMoEConfig, block_r: int) -> tuple[type[MoELoRAPath], object]:
    """(path class, config) serving `lora` on a pool of block_r tile columns; the no-LoRA path without `lora`."""
    if lora is None:
        return MoELoRAPath, None
    cfg = config.lora_for(block_r)
    return lora_paths()[cfg.path].resolve(cfg, lora.gate_up_a.shape[0], block_r)


def _config(x, w_gate_up, E, H, inter, T, K, table, act_quant: bool) -> FusedMoEConfig:
    """The tuned table's config of this call (for e4m3 weights its FP8 entry of the activation mode)."""
    name = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
    if w_gate_up.dtype == FP8_DTYPE:
        return fp8_moe_config(E, H, inter, T, K, x.dtype, name, table, act_quant)
    return tuned_fused_moe_config(E, H, inter, T, K, x.dtype, name, table)


def _plan(topk_ids, E, config: FusedMoEConfig, route_rows, expert_map, pdl: bool) -> MoERoutingPlan:
    # under an expert map the sorted plan: a per-route block of another rank's route would still run its GEMM
    if config.plan_per_route and expert_map is None:
        return per_route_plan(topk_ids, E, config.block_m, route_rows)
    return build_routing_plan(topk_ids, E, config.block_m, expert_map=expert_map, pdl=pdl)


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, lora: ExpertLoRAArgs | None = None, out: torch.Tensor | None = None,
              config: FusedMoEConfig | None = None, side_stream: torch.cuda.Stream | None = None,
              table: str | None = None, route_rows: dict | None = None, expert_map: torch.Tensor | None = None,
              fp8: FP8ExpertScales | None = None, x_fp8: FP8Rows | None = None, pdl: bool = False) -> torch.Tensor:
    """`fused_moe_ref` on the GPU -> out [T, H] (new, or `out=`). `side_stream`: the delta paths'; `table`: where
    `config` None is looked up; `route_rows`: the caller's cache of `per_route_plan`'s rows; `expert_map`
    [E_global] int32: only this rank's routes; `fp8`: the scales of e4m3 weights and their activation mode, `x_fp8`
    x already quantized for W8A8; `pdl`: every launch with programmatic dependent launch where the GPU has it
    (`kernels.pdl`)."""
    T, H, E, inter, K = _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids)
    block_r = _check_lora(lora, T, H, E, inter) if lora is not None else 16
    config = config or _config(x, w_gate_up, E, H, inter, T, K, table, fp8 is not None and fp8.quantize_activations)
    check_fp8(x, E, H, inter, fp8, config, w_gate_up)
    _check_tma(x, H, inter, config)
    out = output(out, (T, H), x.dtype, x.device, (x, w_gate_up, w_down))
    if T == 0:
        return out
    plan = _plan(topk_ids, E, config, route_rows, expert_map, pdl)
    ids = topk_ids if plan.local_ids is None else plan.local_ids  # local ids, -1: another rank's route
    cls, lora_cfg = lora_path(lora, config, block_r)
    path = cls(MoECall(x, plan, ids, lora, block_r, inter, config.gate_up.block_n, side_stream, pdl), lora_cfg)
    gu, dn = config.gate_up, config.down
    h = torch.empty(plan.sorted_route_ids.shape[0], inter, dtype=x.dtype, device=x.device)
    y = torch.empty(T * K, H, dtype=x.dtype, device=x.device)
    gu_out = path.gate_up_out(h)
    launch = pdl_args(pdl, x)
    common = dict(sorted_ids_ptr=plan.sorted_route_ids, eob_ptr=plan.expert_of_block, num_padded_ptr=plan.num_padded,
                  n_routes=T * K, top_k=K, H=H, inter=inter, num_blocks=plan.max_blocks, BM=config.block_m,
                  GROUP_M=GROUP_M, USE_TMA=config.use_tma, **launch)
    w_gu, w_dn, h_in = _tma_operands(w_gate_up, w_down, h, config) if config.use_tma else (w_gate_up, w_down, h)
    fp8_gate_up = fp8_launch_args(fp8, "gate_up", inter, x, a_fp8=x_fp8, pdl=pdl)  # W8A8: x quantized (or x_fp8)
    path.before_gate_up()
    gate_up_kernel[(plan.max_blocks * cdiv(inter, gu.block_n),)](  # gate_up (+ the activation, unless RAW_OUT)
        x, w_gu, gu_out, stride_xt=x.stride(0), stride_we=w_gate_up.stride(0), stride_wn=w_gate_up.stride(1),
        stride_hp=gu_out.stride(0), BN=gu.block_n, BK=gu.block_k, num_warps=gu.num_warps, num_stages=gu.num_stages,
        h_act_ptr=h, stride_act=h.stride(0), **common, **path.gate_up_args(), **fp8_gate_up)
    path.after_gate_up(gu_out, h)  # the activation of a raw gate_up output
    fp8_down = fp8_launch_args(fp8, "down", inter, h, plan.num_padded, pdl=pdl)  # W8A8: h quantized (new buffers)
    path.before_down(h)
    topk_w = topk_weights.contiguous()
    down_kernel[(plan.max_blocks * cdiv(H, dn.block_n),)](
        h_in, h, w_dn, y, topk_w, stride_hp=h.stride(0), stride_we=w_down.stride(0), stride_wn=w_down.stride(1),
        stride_yr=y.stride(0), BN=dn.block_n, BK=dn.block_k, num_warps=dn.num_warps, num_stages=dn.num_stages,
        **common, **path.down_args(), **fp8_down)
    path.before_combine()
    bt, bh = (1 if T < 64 else 4), min(1024, next_pow2(H))
    combine_kernel[(cdiv(T, bt), cdiv(H, bh))](
        y, out, topk_w, ids, T=T, H=H, stride_yr=y.stride(0), stride_ot=out.stride(0), TOP_K=K, BT=bt, BH=bh,
        HAS_MAP=plan.local_ids is not None, num_warps=4, **path.combine_args(), **launch)
    return out
