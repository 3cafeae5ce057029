"""Fused routed-expert MoE with per-token multi-LoRA: launcher over the Triton kernels of moe_gemm.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, S adapter slots,
R max rank, P plan rows (max_padded).
  x [T, H], w_gate_up [E, 2I, H] (gate rows then up rows), w_down [E, H, I],
  topk_weights [T, K] (float), topk_ids [T, K] (int32/int64) -> out [T, H] (x's dtype)
  lora: ExpertLoRAArgs (gate_up_a [S, E, R, H], gate_up_b [S, E, 2I, R], down_a [S, E, R, I],
        down_b [S, E, H, R], token_slots [T] int32 (-1: none), gate_up_ranks / down_ranks [S] int32)

Launches (no host sync, fixed sizes: CUDA-graph safe; one stream unless `side_stream` is given):
  plan -> [shrink x A_gu] -> gate_up GEMM + LoRA + SiLU*up -> h [P, I]
       -> [shrink h A_d] -> down GEMM + LoRA, x routing weight -> y [T*K, H] -> sum over K -> out
(bracketed launches only on the separate-shrink path: lora_shrink="separate", or any pool of max
rank > 16 under "inline", and on "stacked", whose shrink writes xa [P, S * BLOCK_R] in x's dtype, each
row in its slot's columns, and whose GEMMs expand it as more K steps); under "route" (per
route) and "block" (per plan block and slot) they compute each route's whole delta instead, [T*K,
2I] and [T*K, H] in x's dtype (fp32 for route on pools of max rank > 16): the gate_up epilogue adds the first
(or, with lora_gate_up_at="activation", act_delta_kernel after a gate_up GEMM that writes gate and
up unactivated, so that with `side_stream` the gate_up delta runs concurrently with that GEMM); the
second, times the routing weight, is added by the top-k combine, so with `side_stream` the down
delta runs on that stream concurrently with the down GEMM (both read h only). Under "spread" there is
no bracketed launch: the gate_up GEMM also writes the gate_up shrink's partials (and gate / up raw for
rows with a delta), act_spread_kernel expands them, applies SiLU * up and writes the down shrink's
partials, and the down epilogue expands those (`moe_gemm`). The top-k combine sums
y's K rows in a fixed order, so results are deterministic (with or without the side stream). x and
the weights are never written (contract 2). Rows on slot -1 do no LoRA work; a slot of rank r reads only r rows of A /
columns of B and, on the separate path, loops over ceil(r/16) rank chunks whatever the pool's
max rank.
"""

from __future__ import annotations

import torch
import triton

from moelora.kernels.checks import lora_tile_rank
from moelora.kernels.moe_config import FusedMoEConfig, tuned_fused_moe_config
from moelora.kernels.moe_gemm import act_delta_kernel, act_spread_kernel, combine_kernel, down_kernel, gate_up_kernel
from moelora.kernels.moe_lora import (
    lora_block_delta_kernel,
    lora_route_delta_kernel,
    lora_shrink_kernel,
    lora_stacked_shrink_kernel,
)
from moelora.kernels.moe_plan import (
    EXPERT_SORTED_PADDED,
    ROUTE_PER_BLOCK,
    MoERoutingPlan,
    build_routing_plan,
    per_route_plan,
)
from moelora.kernels.reference import ExpertLoRAArgs
from moelora.kernels.side_stream import forked, join

ACCEPTED_LAYOUTS = (EXPERT_SORTED_PADDED, ROUTE_PER_BLOCK)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LORA_RC = 16  # rank columns per step of the separate shrink/expand: cost follows each slot's own rank
_BLOCK_TARGET_PROGRAMS = 264  # "block" LoRA: programs to aim for (2 per SM on a 132-SM H200)
_BLOCK_LANES = 8  # "block" LoRA: programs per plan block, one distinct slot each (the last: the rest)
STACK_MAX_COLS = 512  # "stacked" up to this many slot columns (8 slots of rank 64; 32 of 16): 25 MB of xa at M=4096
_STACK_BK = 64  # "stacked" shrink: depth of a K step ([128, 64] x [64, 128] tiles, 3 stages: 96 KB of shared memory)
_SWITCH_MAX_TOKENS = 1024  # lora_block_max_slots: beyond this many tokens the switch's slot count is not tried


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids):
    _need(x.dim() == 2 and x.dtype in _FLOAT_DTYPES, f"x must be [T, H] fp16/bf16/fp32, got "
          f"{tuple(x.shape)} {x.dtype}")
    T, H = x.shape
    _need(w_gate_up.dim() == 3 and w_gate_up.shape[2] == H and w_gate_up.shape[1] % 2 == 0,
          f"w_gate_up must be [E, 2I, H={H}], got {tuple(w_gate_up.shape)}")
    E, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    _need(tuple(w_down.shape) == (E, H, inter), f"w_down must be [E={E}, H={H}, I={inter}], got {tuple(w_down.shape)}")
    _need(topk_ids.dim() == 2 and topk_ids.shape[0] == T and topk_ids.dtype in (torch.int32, torch.int64),
          f"topk_ids must be [T={T}, K] int32/int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    _need(topk_weights.shape == topk_ids.shape and topk_weights.is_floating_point(),
          f"topk_weights must be float {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        _need(t.dtype == x.dtype, f"{name} dtype {t.dtype} != x dtype {x.dtype}")
        _need(t.is_contiguous(), f"{name} must be contiguous")
    _need(x.stride(1) == 1, "x must have unit stride in its last dim")
    for t in (w_gate_up, w_down, topk_weights, topk_ids):
        _need(t.device == x.device, f"all inputs must be on {x.device}")
    return T, H, E, inter, topk_ids.shape[1]


def _check_lora(lora: ExpertLoRAArgs, T, H, E, inter):
    S, _, R, _ = lora.gate_up_a.shape
    want = {"gate_up_a": (S, E, R, H), "gate_up_b": (S, E, 2 * inter, R), "down_a": (S, E, R, inter),
            "down_b": (S, E, H, R)}
    for name, shape in want.items():
        t = getattr(lora, name)
        _need(tuple(t.shape) == shape, f"lora.{name} must be {shape}, got {tuple(t.shape)}")
        _need(t.stride(-1) == 1 and t.is_floating_point(), f"lora.{name} must be float, unit last stride")
    for name in ("gate_up_b", "down_b"):  # B tiles read whole 16-column chunks of a row, up to its stride
        t = getattr(lora, name)
        _need(t.shape[2] <= 1 or t.stride(2) == R, f"lora.{name} must have rows of R={R} contiguous columns, "
              f"got row stride {t.stride(2)}")
    _need(tuple(lora.token_slots.shape) == (T,) and lora.token_slots.dtype == torch.int32,
          f"lora.token_slots must be [T={T}] int32, got {tuple(lora.token_slots.shape)} {lora.token_slots.dtype}")
    for name in ("gate_up_ranks", "down_ranks"):
        t = getattr(lora, name)
        _need(tuple(t.shape) == (S,) and t.dtype == torch.int32 and t.is_contiguous(),
              f"lora.{name} must be contiguous [S={S}] int32, got {tuple(t.shape)} {t.dtype}")
    return lora_tile_rank(R, lora.width)


def _check_tma(x, H, inter, cfg: FusedMoEConfig):
    if not cfg.use_tma:
        return
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9):
        raise ValueError("use_tma=True needs a CUDA GPU of compute capability >= 9.0 (Hopper)")
    if (H * x.element_size()) % 16 or (inter * x.element_size()) % 16:
        raise ValueError(f"use_tma=True needs 16-byte rows: H={H}, I={inter} in {x.dtype}")


def _check_plan(plan: MoERoutingPlan, T, K, E, block_m):
    if plan.layout not in ACCEPTED_LAYOUTS:
        raise ValueError(f"fused_moe accepts plan layouts {ACCEPTED_LAYOUTS}, got {plan.layout!r}")
    _need((plan.num_tokens, plan.top_k, plan.num_experts, plan.block_m) == (T, K, E, block_m),
          f"plan is for (T, K, E, block_m)={(plan.num_tokens, plan.top_k, plan.num_experts, plan.block_m)}, "
          f"call needs {(T, K, E, block_m)}")


def _lora_kernel_args(lora: ExpertLoRAArgs | None, dummy: torch.Tensor, which: str):
    """Pointer and stride arguments of one GEMM's LoRA (gate_up or down); dummies without LoRA."""
    if lora is None:
        return dict(slots_ptr=dummy, ranks_ptr=dummy, a_ptr=dummy, b_ptr=dummy, stride_as=0, stride_ae=0,
                    stride_ar=0, stride_bs=0, stride_be=0, stride_bn=0)
    a, b = getattr(lora, f"{which}_a"), getattr(lora, f"{which}_b")
    return dict(slots_ptr=lora.token_slots, ranks_ptr=getattr(lora, f"{which}_ranks"), a_ptr=a, b_ptr=b,
                stride_as=a.stride(0), stride_ae=a.stride(1), stride_ar=a.stride(2),
                stride_bs=b.stride(0), stride_be=b.stride(1), stride_bn=b.stride(2))


def _shrink(src, xa, plan, lora, which, gather, k_dim, block_r, cfg):
    a, ranks = getattr(lora, f"{which}_a"), getattr(lora, f"{which}_ranks")
    split = cfg.lora_split_k
    k_split = triton.cdiv(triton.cdiv(k_dim, split), cfg.lora_block_k) * cfg.lora_block_k
    lanes = min(cfg.lora_shrink_lanes, a.shape[0])
    lora_shrink_kernel[(plan.max_blocks, split, lanes)](
        src, xa, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, lora.token_slots,
        ranks, a, plan.num_routes, plan.top_k, k_dim, k_split, xa.shape[1], src.stride(0),
        a.stride(0), a.stride(1), a.stride(2), lanes, GATHER_TOKENS=gather, BM=plan.block_m, BLOCK_R=block_r,
        LORA_BK=cfg.lora_block_k, LORA_RC=_LORA_RC, num_warps=4, num_stages=2)


def _stacked_shrink(src, xa, plan, lora, which, gather, k_dim, block_r, cfg: FusedMoEConfig):
    """xa [P, S * block_r] ("stacked"): each plan row's src @ A^T in its slot's lane of columns."""
    a, ranks = getattr(lora, f"{which}_a"), getattr(lora, f"{which}_ranks")
    cw = min(cfg.lora_stack_n, triton.next_power_of_2(xa.shape[1]))
    lora_stacked_shrink_kernel[(plan.max_blocks, triton.cdiv(xa.shape[1], cw))](
        src, xa, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, lora.token_slots, ranks, a,
        plan.num_routes, plan.top_k, k_dim, a.shape[0], src.stride(0), xa.stride(0), a.stride(0), a.stride(1),
        a.stride(2), GATHER_TOKENS=gather, BM=plan.block_m, BLOCK_R=block_r, CW=cw, BK=_STACK_BK,
        S_P2=triton.next_power_of_2(a.shape[0]),
        num_warps=8 if plan.block_m * cw >= 8192 else 4, num_stages=3)


def _switch_args(plan, lora, cfg: FusedMoEConfig, side: int) -> dict:
    """Launch arguments of one side of the route / block switch (`slots_skip`); side 0: no switch."""
    if not side:
        return dict(max_slots=0)
    return dict(max_slots=cfg.lora_block_max_slots, SWITCH=side,
                T_P2=triton.next_power_of_2(plan.num_routes // plan.top_k),
                S_P2=triton.next_power_of_2(lora.gate_up_a.shape[0]))


def _route_delta(src, delta, plan, topk_ids, lora, which, block_r, cfg: FusedMoEConfig, switch: int = 0):
    """delta [T*K, N] of every route with LoRA (gate_up: N = 2I from x; down: N = H from h [P, I]).
    Programs in plan order for down (h rows are plan rows) and, lora_route_order "plan", for gate_up too."""
    a, b, ranks = getattr(lora, f"{which}_a"), getattr(lora, f"{which}_b"), getattr(lora, f"{which}_ranks")
    by_row = which == "down" or cfg.lora_route_order == "plan"
    n_out, k_dim = b.shape[2], a.shape[3]
    rows = plan.sorted_route_ids.shape[0] if by_row else plan.num_routes
    step = cfg.lora_route_tile // _LORA_RC  # [RC, step] tiles: lora_route_tile elements per load
    # enough programs to cover the SMs (lora_route_programs) even at a few routes, each streaming whole B rows
    n_split = max(1, min(triton.cdiv(n_out, step), triton.cdiv(cfg.lora_route_programs, plan.num_routes)))
    per_split = triton.cdiv(triton.cdiv(n_out, n_split), step) * step
    lora_route_delta_kernel[(rows, triton.cdiv(n_out, per_split))](
        src, delta, topk_ids, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, lora.token_slots,
        ranks, a, b, plan.num_routes, plan.top_k, k_dim, n_out, per_split, src.stride(0), delta.stride(0),
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2), BY_PLAN_ROW=by_row,
        SRC_BY_TOKEN=which == "gate_up", BM=plan.block_m, RC=_LORA_RC, BK=step, BN=step,
        WIDE_RC=max(_LORA_RC, block_r), WIDE_MIN=2 * _LORA_RC, STAGES=cfg.lora_route_stages,
        num_warps=cfg.lora_route_warps,
        **_switch_args(plan, lora, cfg, switch))


def _block_delta(src, delta, plan, lora, which, block_r, cfg, switch: int = 0):
    """delta [T*K, N] of every route with LoRA, per (plan block, slot) ("block" mode)."""
    a, b, ranks = getattr(lora, f"{which}_a"), getattr(lora, f"{which}_b"), getattr(lora, f"{which}_ranks")
    n_out, k_dim = b.shape[2], a.shape[3]
    lanes = min(_BLOCK_LANES, a.shape[0])
    bn = cfg.lora_block_n
    # default: split N only when blocks x lanes alone leave SMs idle (each split repeats the block's shrink)
    n_split = cfg.lora_n_split or triton.cdiv(_BLOCK_TARGET_PROGRAMS, plan.num_routes)
    n_split = max(1, min(triton.cdiv(n_out, bn), n_split))
    per_split = triton.cdiv(triton.cdiv(n_out, n_split), bn) * bn
    sub = max(1, plan.block_m // (cfg.lora_block_m or plan.block_m))  # programs per plan block
    grid = (plan.max_blocks * sub, lanes, triton.cdiv(n_out, per_split))
    persist = 0 < cfg.lora_block_programs < grid[0] * grid[1] * grid[2]
    lora_block_delta_kernel[(cfg.lora_block_programs,) if persist else grid](
        src, delta, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, lora.token_slots,
        ranks, a, b, plan.num_routes, plan.top_k, k_dim, n_out, per_split, lanes, src.stride(0),
        delta.stride(0), a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        BY_PLAN_ROW=which == "down", BM=plan.block_m, BLOCK_R=block_r, BK=cfg.lora_block_k, BN=bn, SUB=sub,
        PERSIST=persist, B_CHUNKS=cfg.lora_block_b_chunks, num_warps=4, **_switch_args(plan, lora, cfg, switch))


def _delta_on(side, mode, src, delta, plan, topk_ids, lora, which, block_r, cfg):
    """The route / block delta of `which` into `delta`, on `side` when given (forked after the work
    queued so far on the current stream; the caller joins before reading `delta`), else here."""
    with forked(side, src.device):
        if mode == "route" and cfg.lora_block_max_slots and plan.num_routes // plan.top_k <= _SWITCH_MAX_TOKENS:
            # both launched; on the device exactly one runs, by the batch's distinct slots (few: block)
            _block_delta(src, delta, plan, lora, which, block_r, cfg, switch=1)
            _route_delta(src, delta, plan, topk_ids, lora, which, block_r, cfg, switch=2)
        elif mode == "route":
            _route_delta(src, delta, plan, topk_ids, lora, which, block_r, cfg)
        else:
            _block_delta(src, delta, plan, lora, which, block_r, cfg)


def _expand_lanes(cfg: FusedMoEConfig, block_r: int) -> int:
    """Slots the separate path's epilogue expands in one dot (`lora_expand_lanes`), at most 128 // block_r
    (a [lanes * block_r, BN] B tile)."""
    return min(cfg.lora_expand_lanes, max(1, 128 // block_r))


def lora_mode(lora: ExpertLoRAArgs | None, config: FusedMoEConfig, block_r: int) -> str | None:
    """The LoRA path of a call: `FusedMoEConfig.shrink_mode`, except that "stacked" on a pool of more than
    STACK_MAX_COLS slot columns (S * block_r) goes "separate": its xa buffer ([P, S * block_r]) and its
    expand steps (one per slot up to a block's largest) grow with the pool, not with the batch's adapters."""
    if lora is None:
        return None
    mode = config.shrink_mode(block_r)
    if mode == "stacked" and lora.gate_up_a.shape[0] * block_r > STACK_MAX_COLS:
        return "separate"
    return mode


def _lora_buffers(lora, config: FusedMoEConfig, block_r: int, x: torch.Tensor, P: int, n_routes: int, inter: int):
    """(mode, xa, delta_gu, delta_d): the LoRA path this call takes (`lora_mode`) and its
    scratch buffers (x as a dummy where a path has none). "separate": the gate_up and then the down
    shrink's xa, one [SPLIT, P, block_r] fp32 buffer for both."""
    mode = lora_mode(lora, config, block_r)
    xa = delta_gu = delta_d = x
    if mode == "spread":  # the gate_up shrink's partials, then the down shrink's (`_spread_parts`)
        gu_parts, _, d_parts, _ = _spread_parts(x.shape[1], inter, config)
        xa = torch.empty(gu_parts + d_parts, P, block_r, dtype=torch.float32, device=x.device)
    elif mode == "separate":
        xa = torch.empty(config.lora_split_k, P, block_r, dtype=torch.float32, device=x.device)
    elif mode == "stacked":  # the gate_up and then the down shrink's, in x's dtype (the twin rounds xa so)
        xa = torch.empty(P, lora.gate_up_a.shape[0] * block_r, dtype=x.dtype, device=x.device)
    elif mode in ("route", "block"):
        # route: wide slots in rank chunks summed in the buffer (fp32 for pools wider than one chunk);
        # block: one pass per (slot, expert) pair, so x's dtype (a route pick's block switch shares
        # route's buffer, and so its dtype)
        d_dtype = x.dtype if block_r <= _LORA_RC or mode == "block" else torch.float32
        delta_gu = torch.empty(n_routes, 2 * inter, dtype=d_dtype, device=x.device)
        delta_d = torch.empty(n_routes, x.shape[1], dtype=d_dtype, device=x.device)
    return mode, xa, delta_gu, delta_d


def _spread_parts(H: int, inter: int, config: FusedMoEConfig) -> tuple[int, int, int, int]:
    """"spread": (gate_up shrink partials, x columns each, down shrink partials, h columns each). The gate_up
    GEMM's programs of output tile n take x columns [n k, (n + 1) k) (k a multiple of lora_block_k), so every
    column is shrunk once; act_spread_kernel's programs take lora_block_n columns of h each."""
    n_tiles = triton.cdiv(inter, config.gate_up.block_n)
    gu_k = triton.cdiv(triton.cdiv(H, n_tiles), config.lora_block_k) * config.lora_block_k
    d_n = min(config.lora_block_n, triton.next_power_of_2(inter))
    return triton.cdiv(H, gu_k), gu_k, triton.cdiv(inter, d_n), d_n


def _tma_operands(w_gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor, config: FusedMoEConfig):
    """Hopper tensor descriptors of the weight tiles and of the down GEMM's activation tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, two_i, H = w_gate_up.shape
    gu, dn = config.gate_up, config.down
    return (TensorDescriptor.from_tensor(w_gate_up.view(E * two_i, H), [gu.block_n, gu.block_k]),
            TensorDescriptor.from_tensor(w_down.view(E * H, two_i // 2), [dn.block_n, dn.block_k]),
            TensorDescriptor.from_tensor(h, [config.block_m, dn.block_k]))


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, lora: ExpertLoRAArgs | None = None, out: torch.Tensor | None = None,
              config: FusedMoEConfig | None = None, plan: MoERoutingPlan | None = None,
              side_stream: torch.cuda.Stream | None = None, table: str | None = None,
              route_rows: dict | None = None) -> torch.Tensor:
    """Routed experts (+ routed LoRA) of `fused_moe_ref`, on the GPU. Returns `out` ([T, H], x's dtype;
    a new tensor unless the caller passes its own `out=`). `plan` may be passed to share one routing
    plan with other consumers; it must match this call's T, K, E and the config's block_m.
    `side_stream`: a second CUDA stream for the route / block down LoRA delta (forked and joined
    inside this call; the same kernels, so the same result bit for bit). `table`: the tuned-config
    table file `config` is taken from when None (`moe_config.check_table_file`; default: the package's).
    `route_rows`: the caller's cache of `per_route_plan`'s constant rows (config.plan_per_route), kept
    across its calls; None: made on each call."""
    T, H, E, inter, K = _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids)
    block_r = _check_lora(lora, T, H, E, inter) if lora is not None else 16
    if config is None:
        name = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
        config = tuned_fused_moe_config(E, H, inter, T, K, x.dtype, name, table)
    _check_tma(x, H, inter, config)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _need(tuple(out.shape) == (T, H) and out.dtype == x.dtype and out.stride(1) == 1,
          f"out must be [T={T}, H={H}] {x.dtype} with unit last stride")
    if T == 0:
        return out
    _need(all(out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
              for t in (x, w_gate_up, w_down)), "out must not alias an input (contract 2)")
    if plan is None and config.plan_per_route:
        plan = per_route_plan(topk_ids, E, config.block_m, route_rows)
    elif plan is None:
        plan = build_routing_plan(topk_ids, E, config.block_m)
    _check_plan(plan, T, K, E, config.block_m)
    P, BM, gu, dn = plan.sorted_route_ids.shape[0], config.block_m, config.gate_up, config.down
    h = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(T * K, H, dtype=x.dtype, device=x.device)
    mode, xa, delta_gu, delta_d = _lora_buffers(lora, config, block_r, x, P, T * K, inter)
    common = dict(sorted_ids_ptr=plan.sorted_route_ids, eob_ptr=plan.expert_of_block,
                  num_padded_ptr=plan.num_padded, n_routes=T * K, top_k=K, H=H, inter=inter,
                  num_blocks=plan.max_blocks, BM=BM, GROUP_M=config.group_m,
                  INLINE_SHRINK=mode == "inline",
                  EXPAND_LANES=_expand_lanes(config, block_r) if mode == "separate" else 0,
                  STACKED=mode == "stacked", stride_xa=xa.stride(0),
                  n_slots=lora.gate_up_a.shape[0] if lora is not None else 0,
                  S_P2=triton.next_power_of_2(lora.gate_up_a.shape[0]) if mode == "stacked" else 1,
                  BLOCK_R=block_r, LORA_BK=config.lora_block_k, LORA_RC=_LORA_RC, USE_TMA=config.use_tma)
    w_gu, w_dn, h_in = _tma_operands(w_gate_up, w_down, h, config) if config.use_tma else (w_gate_up, w_down, h)
    route_deltas = mode in ("route", "block")  # each route's whole gate_up and down delta, computed first
    # "activation": the gate_up delta is added after the GEMM (act_delta_kernel), so it may run on the
    # side stream next to the GEMM; "epilogue": the GEMM adds it, so it runs first
    late_gu = route_deltas and config.lora_gate_up_at == "activation"
    # "spread": no LoRA launch of its own; each GEMM program shrinks a share of its input, the next kernel
    # expands: gate_up GEMM (raw gate / up, gate_up shrink) -> act_spread_kernel (expand, SiLU * up, down
    # shrink) -> down GEMM (expand in the epilogue, as "separate")
    spread = mode == "spread"
    gu_out = torch.empty(P, 2 * inter, dtype=x.dtype, device=x.device) if late_gu or spread else h
    gu_parts, gu_k, d_parts, d_n = _spread_parts(H, inter, config) if spread else (0, 0, config.lora_split_k, 0)
    xa_d = xa[gu_parts:] if spread else xa
    if mode == "separate":
        _shrink(x, xa, plan, lora, "gate_up", True, H, block_r, config)
    elif mode == "stacked":
        _stacked_shrink(x, xa, plan, lora, "gate_up", True, H, block_r, config)
    elif route_deltas:
        # Fork when late_gu (contract 2): the side stream reads x, the plan, topk_ids and the LoRA
        # slots and writes only delta_gu; the GEMM here reads x and writes only gu_out. Both were
        # allocated on this stream before the fork and stay referenced past the join below.
        _delta_on(side_stream if late_gu else None, mode, x, delta_gu, plan, topk_ids, lora, "gate_up", block_r,
                  config)
    gate_up_kernel[(plan.max_blocks * triton.cdiv(inter, gu.block_n),)](
        x, w_gu, gu_out, stride_xt=x.stride(0), stride_we=w_gate_up.stride(0), stride_wn=w_gate_up.stride(1),
        stride_hp=gu_out.stride(0), BN=gu.block_n, BK=gu.block_k, num_warps=gu.num_warps, delta_ptr=delta_gu,
        stride_dr=delta_gu.stride(0), num_stages=gu.num_stages, LORA_DELTA=route_deltas and not late_gu,
        RAW_OUT=late_gu or spread, xa_ptr=xa, XA_SPLIT=config.lora_split_k, HAS_LORA=mode in ("inline", "separate"),
        SPREAD=spread, spread_k=gu_k, h_act_ptr=h, stride_act=h.stride(0), **common,
        **_lora_kernel_args(lora, x, "gate_up"))
    if late_gu:
        join(side_stream, x.device)  # delta_gu is complete
        bn = min(256, triton.next_power_of_2(inter))
        act_delta_kernel[(plan.max_blocks, triton.cdiv(inter, bn))](
            gu_out, delta_gu, h, plan.sorted_route_ids, plan.num_padded, lora.token_slots, lora.gate_up_ranks, T * K,
            K, inter, gu_out.stride(0), delta_gu.stride(0), h.stride(0), BM=BM, BN=bn, num_warps=4)
    elif spread:
        gb, da = lora.gate_up_b, lora.down_a
        act_spread_kernel[(plan.max_blocks, d_parts)](
            gu_out, h, plan.sorted_route_ids, plan.expert_of_block, plan.num_padded, lora.token_slots,
            lora.gate_up_ranks, gb, xa, lora.down_ranks, da, xa_d, T * K, K, inter, plan.max_blocks, gu_out.stride(0),
            h.stride(0), gb.stride(0), gb.stride(1), gb.stride(2), da.stride(0), da.stride(1), da.stride(2), BM=BM,
            BN=d_n, BLOCK_R=block_r, GU_SPLIT=gu_parts, LORA_RC=_LORA_RC, num_warps=4)
    if mode == "separate":
        _shrink(h, xa, plan, lora, "down", False, inter, block_r, config)
    elif mode == "stacked":  # after the gate_up GEMM on this stream, which has read the gate_up xa
        _stacked_shrink(h, xa, plan, lora, "down", False, inter, block_r, config)
    elif route_deltas:
        # Fork (contract 2): the side stream reads h, the plan, topk_ids and the LoRA slots and writes
        # only delta_d; the down GEMM on this stream reads h and writes only y. delta_d, h and y were
        # allocated on this stream before the fork and stay referenced until after the join, so no
        # block is reused while the side stream still touches it; delta_d is read after the join.
        _delta_on(side_stream, mode, h, delta_d, plan, topk_ids, lora, "down", block_r, config)
    topk_w = topk_weights.contiguous()
    down_kernel[(plan.max_blocks * triton.cdiv(H, dn.block_n),)](
        h_in, h, w_dn, y, topk_w, stride_hp=h.stride(0), stride_we=w_down.stride(0),
        stride_wn=w_down.stride(1), stride_yr=y.stride(0), BN=dn.block_n, BK=dn.block_k, num_warps=dn.num_warps,
        num_stages=dn.num_stages, xa_ptr=xa_d, XA_SPLIT=d_parts, HAS_LORA=mode in ("inline", "separate", "spread"),
        **common, **_lora_kernel_args(lora, x, "down"))
    if route_deltas:
        join(side_stream, x.device)  # delta_d is complete
    bt = 1 if T < 64 else 4
    bh = min(1024, triton.next_power_of_2(H))
    slots, ranks = (lora.token_slots, lora.down_ranks) if route_deltas else (x, x)
    combine_kernel[(triton.cdiv(T, bt), triton.cdiv(H, bh))](
        y, out, topk_w, delta_d, slots, ranks, T, H, y.stride(0), out.stride(0), delta_d.stride(0), TOP_K=K, BT=bt,
        BH=bh, HAS_DELTA=route_deltas, num_warps=4)
    return out
