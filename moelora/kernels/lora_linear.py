"""Dense linear with per-token multi-LoRA: y = x W^T + b + x A_s^T B_s^T (s = slot of the row).

Shape legend: T tokens, N_in / N_out features, S adapter slots, R max rank, G output segments.
  x [T, N_in], weight [N_out, N_in], bias [N_out] | None, lora: DenseLoRAArgs | None     -> y [T, N_out]
The config, default picks and checks; the modes are `moelora.kernels.dense_lora`, one per file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from moelora.kernels.args import DenseLoRAArgs
from moelora.kernels.checks import check_rows, need, need_at_least, need_one_of, need_pow2, output
from moelora.kernels.dense_lora import MODES
from moelora.kernels.dense_policy import DENSE_LORA_POLICY, PLAN_BLOCK_M, PLANNED_MAX_ROWS, DenseLoRAPolicy


@dataclass(frozen=True)
class LoRALinearConfig:
    """`mode` (a `MODES` name) and its tiles: block_m x block_n the expand's output tile, block_k the shrink's depth
    step (concat: block_m x block_k its shrink's step, block_n x plan_cols its weight copy's tile), split_k its N_in
    chunks (0: from the shapes), slot_lanes programs a row block taking one distinct slot each; gemm_*: splitk's base
    GEMM; plan_cols: planned's columns a program; expand_first: split's expand writes the delta (+ bias) into the
    output before the GEMM, which adds onto it (cuBLAS beta = 1; one slot lane): the output is written twice and read
    once, not written, read and written again; pdl: the modes' launches with programmatic dependent launch where the
    GPU has it (`kernels.pdl`; set from `lora_linear`'s `pdl`)."""

    mode: str = "split"
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 0
    slot_lanes: int = 8
    num_warps: int = 4
    num_stages: int = 2
    gemm_block_n: int = 64
    gemm_block_k: int = 128
    gemm_split_k: int = 4
    plan_cols: int = 512
    expand_first: bool = False
    pdl: bool = False

    def __post_init__(self):
        need_one_of("LoRALinearConfig", "mode", self.mode, tuple(MODES))
        need_pow2("LoRALinearConfig", block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                  gemm_block_n=self.gemm_block_n, gemm_block_k=self.gemm_block_k)
        need_at_least("LoRALinearConfig", 1, gemm_split_k=self.gemm_split_k, slot_lanes=self.slot_lanes,
                      plan_cols=self.plan_cols)
        need_at_least("LoRALinearConfig", 0, split_k=self.split_k)
        need(not self.expand_first or (self.mode == "split" and self.slot_lanes == 1),
             lambda: f"LoRALinearConfig: expand_first is split's with one slot lane, got mode {self.mode!r} and "
                     f"slot_lanes={self.slot_lanes}")


@functools.lru_cache(maxsize=4096)
def default_lora_linear_config(num_tokens: int, mode: str | None = None, n_in: int = 0, n_out: int = 0,
                               has_lora: bool = True, row_plan: bool = False,
                               policy: DenseLoRAPolicy = DENSE_LORA_POLICY, pdl: bool = False) -> LoRALinearConfig:
    """The measured picks (docs/performance.md); `mode` None: `policy.mode` picks it. Cached: a pure function of
    its arguments (policies are frozen, equal by class), asked once a dense site a step (its construction and
    checks ~15 us of host a call under cProfile, 135 calls a DeepSeek-V2-Lite prefill forward)."""
    if mode is None:
        mode = policy.mode(num_tokens, n_in, n_out, has_lora, row_plan)
    if mode == "splitk":
        return LoRALinearConfig("splitk", 16, 64, 128, split_k=8, pdl=pdl)
    if mode == "planned":
        return LoRALinearConfig("planned", PLAN_BLOCK_M, 128, 256, num_stages=4, pdl=pdl)  # 512 columns a program
    if mode == "concat":  # the H200 sweep's best at T = 8192 (docs/performance.md): 64 x 128 shrink steps, 8 warps,
        # 4 stages; the weight copied in 32 x 64 tiles
        return LoRALinearConfig("concat", 64, 32, 128, num_warps=8, num_stages=4, plan_cols=64, pdl=pdl)
    if num_tokens <= 32:
        # 8 shrink splits, not the shapes' 16: half the partials to sum (docs/performance.md, dense tiles)
        return LoRALinearConfig("split", 16, 64, 128, split_k=8, pdl=pdl)
    # 4 warps, not 8 (docs/performance.md, dense tiles). Above "planned"'s rows a call is prefill, its rows a prompt
    # (one slot) at a time: one slot lane, where 8 lanes left 7 programs of each row block with nothing to do, and
    # the delta written before the GEMM, which adds onto it (no pass over the output after it)
    if num_tokens > PLANNED_MAX_ROWS:
        return LoRALinearConfig("split", 64, 128, 128, slot_lanes=1, expand_first=True, pdl=pdl)
    return LoRALinearConfig("split", 64, 128, 128, pdl=pdl)


def _check(x, weight, bias, lora):
    need(x.dim() == 2, lambda: f"x must be [T, N_in], got {tuple(x.shape)}")
    check_rows("x", x)
    T, n_in = x.shape
    if weight.dim() != 2 or weight.shape[1] != n_in or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [N_out, N_in={n_in}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    n_out = weight.shape[0]
    if bias is not None and (tuple(bias.shape) != (n_out,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [N_out={n_out}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if lora is not None:
        check_lora(lora, T, n_in, n_out)
    return T, n_in, n_out


def check_lora(lora: DenseLoRAArgs, T: int, n_in: int, n_out: int) -> None:
    """`lora` for a linear of T rows, N_in -> N_out (shapes: `DenseLoRAArgs`); ValueError naming the field."""
    segs = lora.segments
    G = max(1, len(segs))
    S, GR = lora.a.shape[0], lora.a.shape[1]
    if segs and (sum(segs) != n_out or min(segs) < 0 or GR % G):
        raise ValueError(f"lora.segments must be sizes summing to N_out={n_out}, and a's rows a multiple of their "
                         f"number, got {segs} and a {tuple(lora.a.shape)}")
    R = GR // G
    for name, t, shape in (("a", lora.a, (S, GR, n_in)), ("b", lora.b, (S, n_out, R))):
        if tuple(t.shape) != shape or t.stride(-1) != 1 or not t.is_floating_point():
            raise ValueError(f"lora.{name} must be float {shape} with unit last stride, got {tuple(t.shape)}")
    if n_out > 1 and lora.b.stride(1) != R:  # B tiles read whole 16-column chunks of a row, up to its stride
        raise ValueError(f"lora.b must have rows of R={R} contiguous columns, got row stride {lora.b.stride(1)}")
    if tuple(lora.token_slots.shape) != (T,) or lora.token_slots.dtype != torch.int32:
        raise ValueError(f"lora.token_slots must be [T={T}] int32, got {tuple(lora.token_slots.shape)} "
                         f"{lora.token_slots.dtype}")
    if lora.slots is not None and (lora.slots.dim() != 1 or lora.slots.dtype != torch.int32):
        raise ValueError(f"lora.slots must be [n] int32, got {tuple(lora.slots.shape)} {lora.slots.dtype}")
    plan = lora.row_plan
    if plan is not None and (plan.num_tokens != T or plan.top_k != 1 or plan.num_experts != max(1, S)):
        raise ValueError(f"lora.row_plan must group T={T} rows over S={S} slots, got one of {plan.num_tokens} rows "
                         f"x {plan.top_k} over {plan.num_experts}")
    ranks_shape = (G, S) if segs else (S,)
    if tuple(lora.slot_ranks.shape) != ranks_shape or lora.slot_ranks.dtype != torch.int32 \
            or not lora.slot_ranks.is_contiguous():
        raise ValueError(f"lora.slot_ranks must be contiguous {list(ranks_shape)} int32, got "
                         f"{tuple(lora.slot_ranks.shape)} {lora.slot_ranks.dtype}")


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora: DenseLoRAArgs | None, *, out: torch.Tensor | None = None,
                config: LoRALinearConfig | None = None,
                side_stream: torch.cuda.Stream | None = None,
                policy: DenseLoRAPolicy = DENSE_LORA_POLICY, pdl: bool = False) -> torch.Tensor:
    """`lora_linear_ref` on the GPU -> y [T, N_out] (new, or `out=`); `side_stream`: for split's shrink; `pdl`:
    programmatic dependent launch where the GPU has it (`kernels.pdl`; over `config.pdl`)."""
    T, n_in, n_out = _check(x, weight, bias, lora)
    out = output(out, (T, n_out), x.dtype, x.device, (x, weight, bias))
    if T == 0:
        return out
    has_lora = lora is not None and lora.a.shape[0] > 0
    cfg = config or default_lora_linear_config(T, n_in=n_in, n_out=n_out, has_lora=has_lora,
                                               row_plan=has_lora and lora.row_plan is not None, policy=policy,
                                               pdl=pdl)
    if cfg.pdl != pdl:
        cfg = replace(cfg, pdl=pdl)
    MODES[cfg.mode].run(x, weight, bias, lora if has_lora else None, out, cfg, side_stream)
    return out
