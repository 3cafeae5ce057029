"""Dense linear with per-token multi-LoRA: y = x W^T + b + x A_s^T B_s^T (s = slot of the row).

Shape legend: T tokens, N_in / N_out in / out features, S adapter slots, R max rank
(BLOCK_R = pow2 >= max(16, R)), P shrink splits over N_in.
  x [T, N_in], weight [N_out, N_in], bias [N_out] | None
  lora: DenseLoRAArgs (a [S, R, N_in], b [S, N_out, R] with scaling folded in,
        token_slots [T] int32 (-1: no adapter), slot_ranks [S] int32)       -> y [T, N_out]
  with output segments (G linears merged into one, e.g. q/k/v; `DenseLoRAArgs.segments` = sizes N_g):
        a [S, G*R, N_in] (segment g: rows [gR, gR + R)), b [S, N_out, R] (segment g: rows
        [off_g, off_g + N_g)), slot_ranks [G, S] int32 (contiguous)           -> y [T, N_out]

The base projection is one cuBLAS GEMM into the output buffer this launcher allocates (or the
caller's `out=`); the LoRA delta is then added into that buffer by one of two paths (or a third
replaces both the GEMM and the delta):

- "split" (default): a shrink kernel computes xa = x[t] @ A_slot(t)[:rank]^T once per row into an
  fp32 buffer xa [P, T, BLOCK_R], then an expand kernel adds xa[t] @ B_slot(t)[:, :rank]^T to each
  [BM, BN] output tile (summing the P partials). Shrink program (m, p, lane) takes BM rows, the
  p-th chunk of N_in (so small T still fills the GPU) and the lane-th distinct slot among its rows;
  expand program (m, n, lane) likewise. A row has one slot, so lanes touch disjoint rows: no
  atomics, deterministic. With up to `slot_lanes` distinct slots per row block every program
  handles one slot, so its chain of dependent loads is short: slots and ranks (one round trip),
  then one pipelined N_in chunk (shrink) or y, the partials and one B tile at once (expand), not
  one chain per slot; the last lane takes any further slots in turn. Every row is shrunk
  once, A is read once per (row block, slot, N_in chunk) and B once per (row block, slot, N tile),
  each only up to the slot's own rank (masked loads move no bytes). With a `side_stream` the shrink
  runs there, concurrently with the base GEMM (both only read x), and the expand after the join.
- "splitk" (decode rows, fp16/bf16; the default with LoRA at T <= 16, o-like shapes to 64; see
  `_prefers_splitk`): no cuBLAS. A split-K Triton GEMM whose launch also runs the shrink's
  programs, then one reduce that sums the partials and adds bias and the expand
  (`moelora.kernels.splitk_linear`): LoRA adds no launch.
- "planned" (decode batches past splitk's rows, the default where the caller grouped the rows by slot:
  `DenseLoRAArgs.row_plan`, one launch per step in the engine): the base GEMM (cuBLAS), then one
  kernel that adds each slot's delta over the grouped rows (`moelora.kernels.planned_lora`): a
  program serves one slot, with no lanes and no partials buffer. Asked for without a grouping, it
  builds one itself.
- "fused": the older single kernel: program (m, n) shrinks its rows over the full N_in for each
  distinct slot and expands into its tile, so the shrink repeats N_out / BN times. One launch
  fewer; kept as an off switch and for comparison.

Segments (G > 1) keep one shrink and one expand launch: shrink program (m, p G + g, lane) is the
unsegmented one on segment g's A rows [gR, gR + R) and ranks [g], writing xa [P, T, G, BLOCK_R]
(BLOCK_R = pow2 >= max(16, R)); an expand tile takes, for each segment its columns overlap (one,
unless a segment boundary is not a multiple of BN), that segment's xa and B rows, rank- and
column-masked. Segment boundaries are compile-time constants (`SEG_BOUNDS`); a segment of rank 0 for
a slot moves no x, A or B bytes and skips its dots. G == 1 compiles to the unsegmented kernels.

Row blocks with no adapter exit after one load; rows with slot -1 are neither read nor written
by the LoRA kernels. Grids depend on shapes only and nothing syncs with the host (graph-safe).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import lora_tile_rank, need_at_least, need_one_of, need_pow2
from moelora.kernels.lora_tiles import (
    dense_shrink_program,
    expand_tile,
    lane_rows,
    lora_b_tile,
    lora_b_tile_cols,
    lora_shrink_rows,
)
from moelora.kernels.planned_lora import planned_cols, planned_delta, row_plan
from moelora.kernels.reference import DenseLoRAArgs
from moelora.kernels.side_stream import forked, join
from moelora.kernels.splitk_linear import ShrinkLaunch, splitk_partials, splitk_reduce

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MODES = ("split", "fused", "splitk", "planned")
# "splitk" replaces cuBLAS for rows up to this many (decode), in fp16/bf16; beyond, or in fp32, "split"
_SPLITK_MAX_ROWS = 64
# Shrink programs to aim for with one slot per row block (split over N_in when T alone gives fewer):
# about one per SM on an H200 (132); more slots multiply them through the slot lanes.
_SHRINK_TARGET_PROGRAMS = 128
# "planned": programs to aim for (plan blocks x column splits) when plan_cols is 0, two per SM of an
# H200; the largest row count it is the default for; its plan's rows per block
_PLANNED_TARGET_PROGRAMS = 264
_PLANNED_MAX_ROWS = 1024
PLAN_BLOCK_M = 16


def _prefers_splitk(num_tokens: int, n_in: int, n_out: int, has_lora: bool) -> bool:
    """H200, bf16, shrink folded into the partials' launch (benchmarks/lora_linear.py; docs/benchmarks.md),
    µs per call at T = 1 / 8 / 16 / 64, split path (cuBLAS + shrink + expand) -> splitk:
    8 adapters r16, merged q/k/v 2048->5120: 14.49 -> 13.49, 16.64 -> 15.44, 16.82 -> 15.50, 19.65 -> 35.92;
    o 4096->2048: 14.28 -> 12.81, 17.08 -> 13.66, 17.00 -> 13.54, 19.68 -> 19.02 (1 adapter alike).
    Without LoRA cuBLAS is as fast or faster (q/k/v 8.82 vs 10.56 at T=8). A narrow output, the bf16
    router 2048->128 (Qwen/Mixtral), T = 8 / 32 / 64: 10.61 -> 8.78, 12.41 -> 9.47, 13.28 -> 9.27
    (o at T = 32: 17.98 -> 15.10). So: LoRA rows, T <= 16 on shapes >= 1024 wide; T <= 64 on o-like
    shapes (N_in >= 2 N_out) with N_in >= 1024 and N_out >= 128 (narrower outputs not measured)."""
    if not (has_lora and 0 < num_tokens <= 64 and n_in >= 1024):
        return False
    o_like = n_in >= 2 * n_out and n_out >= 128
    return o_like or (num_tokens <= 16 and n_out >= 1024)


def _prefers_planned(num_tokens: int, n_in: int, n_out: int) -> bool:
    """H200, bf16, plan built once (benchmarks/lora_linear.py; docs/benchmarks.md), µs per call,
    split -> planned (bm16/bn128/bk256/cols512), 8 adapters r16 (1 adapter in brackets):
    merged q/k/v 2048->5120 T = 64 / 128 / 256: 19.82 -> 18.35, 25.38 -> 19.58, 41.92 -> 23.01 (22.60 -> 22.13);
    o 4096->2048 T = 64 / 128 / 256: 19.74 -> 23.03, 21.28 -> 22.94, 29.97 -> 23.37 (24.40 -> 23.29).
    T = 512 / 1024: q/k/v 72.18 -> 35.28, 119.08 -> 55.97 (33.76 -> 35.24, 55.71 -> 56.16); o 45.26 ->
    32.90, 73.77 -> 44.59 (28.02 -> 32.56, 42.09 -> 44.51). A program's full-depth shrink is a latency
    chain: o (4096 deep) gains only from 256 rows, and one adapter alone loses up to 16 % at o. So:
    past splitk's rows up to 1024, from 17 rows on shapes wider than deep (q/k/v-like) and from 129 on
    the others (o-like: unmeasured depths between, e.g. a shared expert's down 2816->2048, are taken as
    deep), on shapes at least 1024 wide (narrower not measured)."""
    if not (n_in >= 1024 and n_out >= 1024 and wants_row_plan(num_tokens)):
        return False
    return n_in <= n_out or num_tokens > 128


def wants_row_plan(num_tokens: int) -> bool:
    """Whether a step of this many rows may take "planned" at some site (so the engine builds the
    rows' grouping by slot once for all of them, with `PLAN_BLOCK_M` rows a block): past the 16
    rows splitk keeps, up to _PLANNED_MAX_ROWS."""
    return 16 < num_tokens <= _PLANNED_MAX_ROWS


@dataclass(frozen=True)
class LoRALinearConfig:
    """Block sizes of the LoRA delta. `mode`: "split" (shrink + expand kernels) or "fused" (one
    kernel). block_m / block_n: the output tile (expand, or fused); block_k: depth step of the
    shrink; shrink_block_m: rows per shrink program; split_k: N_in chunks of the shrink (0: from
    the shapes); slot_lanes: programs per row block that each take one distinct slot (the last one
    takes the rest). num_warps / num_stages: the expand (or fused) kernel (num_warps: also the
    splitk reduce); the shrink runs 4 warps and shrink_num_stages. "splitk" (decode, T <= 64,
    fp16/bf16): a split-K Triton GEMM in gemm_split_k chunks of N_in (gemm_block_n x gemm_block_k
    tiles) instead of cuBLAS, whose launch also runs the split path's shrink programs, and one
    reduce that adds bias and the expand (block_m x block_n tiles); see
    `moelora.kernels.splitk_linear`. "planned": block_m rows of one slot a program (the row plan's
    block), block_n x block_k tiles, plan_cols output columns a program (0: from the shapes);
    plan_shrink "fused" (each program shrinks its rows over the full N_in) or "split" (the split
    path's shrink, split_k / shrink_block_m / slot_lanes, on the side stream when given; the planned
    programs only expand).
    All block sizes are powers of two >= 16 (tl.dot)."""

    mode: str = "split"
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    shrink_block_m: int = 16
    split_k: int = 0
    slot_lanes: int = 8
    num_warps: int = 4
    num_stages: int = 2
    shrink_num_stages: int = 3
    gemm_block_n: int = 64
    gemm_block_k: int = 128
    gemm_split_k: int = 4
    plan_cols: int = 0
    plan_shrink: str = "fused"

    def __post_init__(self):
        need_one_of("LoRALinearConfig", "mode", self.mode, _MODES)
        need_one_of("LoRALinearConfig", "plan_shrink", self.plan_shrink, ("fused", "split"))
        need_pow2("LoRALinearConfig", block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                  shrink_block_m=self.shrink_block_m, gemm_block_n=self.gemm_block_n, gemm_block_k=self.gemm_block_k)
        need_at_least("LoRALinearConfig", 1, gemm_split_k=self.gemm_split_k, slot_lanes=self.slot_lanes)
        need_at_least("LoRALinearConfig", 0, split_k=self.split_k, plan_cols=self.plan_cols)


def default_lora_linear_config(num_tokens: int, mode: str | None = None, n_in: int = 0, n_out: int = 0,
                               has_lora: bool = True, row_plan: bool = False) -> LoRALinearConfig:
    """Decode: short row blocks, many programs; prefill: taller expand tiles, so B is re-read by
    fewer row blocks. Fused: wide N tiles at prefill, so its in-program shrink repeats less.
    `mode` None: "splitk" where it measured faster than cuBLAS + split (`_prefers_splitk`), else, when
    the caller grouped the rows by slot (`row_plan`: `DenseLoRAArgs.row_plan` given), "planned" where
    that did (`_prefers_planned`), else "split"."""
    if mode is None:
        mode = ("splitk" if _prefers_splitk(num_tokens, n_in, n_out, has_lora)
                else "planned" if has_lora and row_plan and _prefers_planned(num_tokens, n_in, n_out) else "split")
    if mode == "splitk":
        return LoRALinearConfig("splitk", 16, 64, 128, 16, split_k=8)
    if mode == "planned":
        # H200 sweep (benchmarks/lora_linear.py --sweep-mode planned), q/k/v and o, T 64..256, 1 and 8 adapters
        return LoRALinearConfig("planned", PLAN_BLOCK_M, 128, 256, plan_cols=512, num_stages=4)
    if mode == "fused":
        if num_tokens <= 32:
            return LoRALinearConfig("fused", 16, 64, 256, num_warps=4)
        return LoRALinearConfig("fused", 64, 256, 64, num_warps=8)
    if num_tokens <= 32:
        # 8 shrink splits, not the 16 the shapes give (H200 sweep, 8 adapters r16, T=8: merged q/k/v
        # 18.41 -> 17.94 µs, o 20.33 -> 19.51 µs): half the partials for the expand to sum
        return LoRALinearConfig("split", 16, 64, 128, 16, split_k=8)
    # 4 warps, not 8 (H200 sweep, merged q/k/v 2048->5120, 8 adapters r16: T=64 29.3 -> 20.2 µs,
    # T=256 74.7 -> 41.7 µs; o 4096->2048 T=256 32.2 -> 27.6 µs)
    return LoRALinearConfig("split", 64, 128, 128, 16)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, xa_ptr, a_ptr, slots_ptr, ranks_ptr, T, N_in, n_slots, k_chunk, n_lanes, R_SEG,
    stride_xt, stride_xap, stride_as, stride_ar,
    BM: tl.constexpr, BLOCK_R: tl.constexpr, BK: tl.constexpr, S_P2: tl.constexpr, G: tl.constexpr,
):
    """xa[p, t, g] = x[t, chunk p] @ A_g,slot(t)[:rank_g, chunk p]^T: program (m, p G + g, lane) is
    `dense_shrink_program` (the splitk mode runs the same programs inside its partials' launch)."""
    dense_shrink_program(x_ptr, xa_ptr, a_ptr, slots_ptr, ranks_ptr, tl.program_id(0), tl.program_id(1),
                         tl.program_id(2), T, N_in, n_slots, k_chunk, n_lanes, R_SEG, stride_xt, stride_xap,
                         stride_as, stride_ar, BM, BLOCK_R, BK, S_P2, G)


@triton.jit
def _lora_expand_add_kernel(
    xa_ptr, y_ptr, b_ptr, slots_ptr, ranks_ptr, T, N_out, n_slots, n_lanes,
    stride_xap, stride_yt, stride_bs, stride_bn,
    BM: tl.constexpr, BN: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, S_P2: tl.constexpr,
    G: tl.constexpr, G_P2: tl.constexpr, SEG_BOUNDS: tl.constexpr,
):
    """y[t, n tile] += (sum_p xa[p, t]) @ B_slot(t)[n tile, :rank]^T for the rows with a slot (with G
    segments: each column's segment's xa columns, B rows and rank; see `expand_segments`).
    Program (m, n, lane) takes the lane-th distinct slot of its rows (the last lane: all the rest);
    a row has one slot, so lanes write disjoint rows."""
    offs_t = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    lane = tl.program_id(2)
    slot, s, mine, ranks = lane_rows(slots_ptr, ranks_ptr, offs_t, T, n_slots, lane, n_lanes, S_P2, G, G_P2)
    if s < 0:
        return
    # Everything whose address is known is loaded before the slot loop: y, and the P partials
    # (unrolled, all in flight at once), so the chain is slots -> {y, xa, B} -> store.
    y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    mask = mine[:, None] & (offs_n[None, :] < N_out)
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    acc = expand_tile(xa_ptr, y_ptr, b_ptr, slot, s, ranks, offs_t, offs_n, mine, lane, n_lanes, N_out, stride_xap,
                      stride_bs, stride_bn, BM, BN, BLOCK_R, SPLIT, S_P2, G, G_P2, SEG_BOUNDS)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_delta_add_fused_kernel(
    x_ptr, y_ptr, a_ptr, b_ptr, slots_ptr, ranks_ptr, T, N_in, N_out, n_slots, R_SEG,
    stride_xt, stride_yt, stride_as, stride_ar, stride_bs, stride_bn,
    BM: tl.constexpr, BN: tl.constexpr, RC: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
    SEG_BOUNDS: tl.constexpr,
):
    offs_t = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    slot = tl.load(slots_ptr + offs_t, mask=offs_t < T, other=-1)
    rows_on = slot >= 0
    s = tl.max(slot, axis=0)
    if s < 0:
        return
    acc = tl.zeros((BM, BN), tl.float32)
    while s >= 0:
        sel = slot == s
        a_s = a_ptr + s.to(tl.int64) * stride_as
        b_s = b_ptr + s.to(tl.int64) * stride_bs
        if G == 1:
            rank = tl.load(ranks_ptr + s)
            for r0 in range(0, rank, RC):  # only the slot's own rank columns, RC at a time
                xa = lora_shrink_rows(x_ptr, offs_t, stride_xt, sel, a_s + r0 * stride_ar, stride_ar, rank - r0, 0,
                                      N_in, BM, RC, BK).to(x_ptr.dtype.element_ty)
                bt = lora_b_tile(b_s, offs_n, N_out, stride_bn, rank, r0, RC)
                acc = tl.dot(xa, bt.to(xa.dtype), acc)
        else:
            n0 = tl.program_id(1) * BN
            for g in tl.static_range(G):  # the segments this tile overlaps, each up to its own rank
                lo = SEG_BOUNDS[g]
                hi = SEG_BOUNDS[g + 1]
                if (n0 < hi) & (n0 + BN > lo):
                    rank = tl.load(ranks_ptr + g * n_slots + s)
                    a_g = a_s + g * R_SEG * stride_ar
                    for r0 in range(0, rank, RC):
                        xa = lora_shrink_rows(x_ptr, offs_t, stride_xt, sel, a_g + r0 * stride_ar, stride_ar,
                                              rank - r0, 0, N_in, BM, RC, BK).to(x_ptr.dtype.element_ty)
                        bt = lora_b_tile_cols(b_s, offs_n, lo, hi, stride_bn, rank, r0, RC)
                        acc = tl.dot(xa, bt.to(xa.dtype), acc)
        slot = tl.where(sel, -1, slot)
        s = tl.max(slot, axis=0)
    y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    mask = rows_on[:, None] & (offs_n[None, :] < N_out)
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _check(x, weight, bias, lora):
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be [T, N_in] fp16/bf16/fp32 with unit last stride, got {tuple(x.shape)} "
                         f"{x.dtype}")
    T, n_in = x.shape
    if weight.dim() != 2 or weight.shape[1] != n_in or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [N_out, N_in={n_in}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    n_out = weight.shape[0]
    if bias is not None and (tuple(bias.shape) != (n_out,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [N_out={n_out}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if lora is not None:
        _check_lora(lora, T, n_in, n_out)
    return T, n_in, n_out


def _check_lora(lora, T, n_in, n_out):
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
    plan = lora.row_plan
    if plan is not None and (plan.num_tokens != T or plan.top_k != 1 or plan.num_experts != max(1, S)):
        raise ValueError(f"lora.row_plan must group T={T} rows over S={S} slots, got one of {plan.num_tokens} rows "
                         f"x {plan.top_k} over {plan.num_experts}")
    ranks_shape = (G, S) if segs else (S,)
    if tuple(lora.slot_ranks.shape) != ranks_shape or lora.slot_ranks.dtype != torch.int32 \
            or not lora.slot_ranks.is_contiguous():
        raise ValueError(f"lora.slot_ranks must be contiguous {list(ranks_shape)} int32, got "
                         f"{tuple(lora.slot_ranks.shape)} {lora.slot_ranks.dtype}")


class _Segments:
    """Launch constants of `lora`'s output segments: G, the pool rank R per segment, the output
    column bounds (None when unsegmented) and BLOCK_R (xa columns per segment)."""

    def __init__(self, lora: DenseLoRAArgs):
        self.G = max(1, len(lora.segments))
        self.r_seg = lora.a.shape[1] // self.G
        self.bounds = tuple(itertools.accumulate(lora.segments, initial=0)) if self.G > 1 else None
        self.block_r = lora_tile_rank(self.r_seg, lora.width)
        self.g_p2 = triton.next_power_of_2(self.G)


def _shrink_split(T: int, n_in: int, block_r: int, cfg: LoRALinearConfig) -> tuple[int, int]:
    """(P chunks, chunk length): N_in cut into BK multiples so that row blocks x P ~ the target.
    The expand keeps P partial [BM, BLOCK_R] fp32 tiles in flight: P is capped so that they stay
    within ~32 registers a thread (sm_90 builds spilled beyond that at BM 64, R 64)."""
    n_kb = max(1, triton.cdiv(n_in, cfg.block_k))
    want = cfg.split_k
    if not want:
        budget = max(1, 32 * 32 * cfg.num_warps // (cfg.block_m * block_r))
        want = min(budget, triton.cdiv(_SHRINK_TARGET_PROGRAMS, triton.cdiv(T, cfg.shrink_block_m)))
    chunk = triton.cdiv(n_kb, max(1, min(want, n_kb))) * cfg.block_k
    return max(1, triton.cdiv(n_in, chunk)), chunk


def _shrink_setup(x, lora, T, n_in, cfg) -> ShrinkLaunch:
    """The shrink's launch, its xa [P, T, G * BLOCK_R] fp32 partials allocated here on the current
    stream."""
    seg = _Segments(lora)
    n_split, chunk = _shrink_split(T, n_in, seg.block_r, cfg)
    xa = torch.empty(n_split, T, seg.G * seg.block_r, dtype=torch.float32, device=x.device)
    S = lora.a.shape[0]
    return ShrinkLaunch(xa, lora.a, lora.token_slots, lora.slot_ranks, n_split, chunk,
                        min(S, cfg.shrink_block_m, cfg.slot_lanes), cfg.shrink_block_m, cfg.block_k,
                        triton.next_power_of_2(S), seg.r_seg, seg.G, seg.block_r, seg.g_p2, seg.bounds)


def _shrink(x, lora, T, n_in, cfg, side_stream=None) -> ShrinkLaunch:
    """Launch the split path's shrink (on `side_stream` when given, after the work queued so far on
    the current stream). Its xa is allocated on the current stream before any fork; the caller keeps
    it until the expand, which runs after the join."""
    sh = _shrink_setup(x, lora, T, n_in, cfg)
    with forked(side_stream, x.device):
        _lora_shrink_kernel[(triton.cdiv(T, sh.block_m), sh.n_split * sh.G, sh.lanes)](
            x, sh.xa, lora.a, lora.token_slots, lora.slot_ranks, T, n_in, lora.a.shape[0], sh.chunk, sh.lanes,
            sh.r_seg, x.stride(0), sh.xa.stride(0), lora.a.stride(0), lora.a.stride(1), BM=sh.block_m,
            BLOCK_R=sh.block_r, BK=sh.block_k, S_P2=sh.s_p2, G=sh.G, num_warps=4, num_stages=cfg.shrink_num_stages)
    return sh


def _expand(out, lora, T, n_out, cfg, sh: ShrinkLaunch):
    S = lora.a.shape[0]
    lanes = min(S, cfg.block_m, cfg.slot_lanes)
    _lora_expand_add_kernel[(triton.cdiv(T, cfg.block_m), triton.cdiv(n_out, cfg.block_n), lanes)](
        sh.xa, out, lora.b, lora.token_slots, lora.slot_ranks, T, n_out, S, lanes, sh.xa.stride(0), out.stride(0),
        lora.b.stride(0), lora.b.stride(1), BM=cfg.block_m, BN=cfg.block_n, BLOCK_R=sh.block_r, SPLIT=sh.n_split,
        S_P2=sh.s_p2, G=sh.G, G_P2=sh.g_p2, SEG_BOUNDS=sh.bounds, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def _add_delta_fused(x, out, lora, T, n_in, n_out, cfg):
    seg = _Segments(lora)
    grid = (triton.cdiv(T, cfg.block_m), triton.cdiv(n_out, cfg.block_n))
    _lora_delta_add_fused_kernel[grid](
        x, out, lora.a, lora.b, lora.token_slots, lora.slot_ranks, T, n_in, n_out, lora.a.shape[0], seg.r_seg,
        x.stride(0), out.stride(0), lora.a.stride(0), lora.a.stride(1), lora.b.stride(0), lora.b.stride(1),
        BM=cfg.block_m, BN=cfg.block_n, RC=16, BK=cfg.block_k, G=seg.G, SEG_BOUNDS=seg.bounds,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _add_delta_planned(x, out, lora, T, n_out, cfg, shrunk: ShrinkLaunch | None = None):
    """The "planned" delta into `out`; `shrunk`: the split path's shrink, already run (plan_shrink "split")."""
    S = lora.a.shape[0]
    plan = lora.row_plan
    if plan is None or plan.block_m != cfg.block_m:
        plan = row_plan(lora.token_slots, S, cfg.block_m)
    seg = _Segments(lora)
    cols = cfg.plan_cols or planned_cols(T, n_out, S, cfg.block_m, cfg.block_n, _PLANNED_TARGET_PROGRAMS)
    planned_delta(x if shrunk is None else shrunk.xa, out, lora.a, lora.b, lora.slot_ranks, plan,
                  seg.bounds or (0, n_out), seg.r_seg, seg.block_r, cols, cfg.block_n, cfg.block_k, cfg.num_warps,
                  cfg.num_stages)


def _splitk_linear(x, weight, bias, lora, out, T, n_in, cfg):
    """"splitk": one launch of split-K partials and, with LoRA, the shrink's programs next to them
    (so no side stream and no join), then one reduce that adds bias and the expand."""
    if lora is None:
        splitk_reduce(splitk_partials(x, weight, cfg.gemm_split_k, cfg.gemm_block_n, cfg.gemm_block_k), out, bias,
                      None, None, cfg.block_m, cfg.block_n, cfg.slot_lanes, cfg.num_warps)
        return
    sh = _shrink_setup(x, lora, T, n_in, cfg)
    ws = splitk_partials(x, weight, cfg.gemm_split_k, cfg.gemm_block_n, cfg.gemm_block_k, shrink=sh)
    splitk_reduce(ws, out, bias, lora, sh, cfg.block_m, cfg.block_n, cfg.slot_lanes, cfg.num_warps)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora: DenseLoRAArgs | None, *, out: torch.Tensor | None = None,
                config: LoRALinearConfig | None = None,
                side_stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """`lora_linear_ref` on the GPU: returns y [T, N_out] (new, or the caller's `out=`).
    `side_stream` (split mode): a second CUDA stream on which the LoRA shrink runs concurrently
    with the base GEMM (forked and joined inside this call; the same kernels, so the same result
    bit for bit)."""
    T, n_in, n_out = _check(x, weight, bias, lora)
    if out is None:
        out = torch.empty(T, n_out, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (T, n_out) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [T={T}, N_out={n_out}] {x.dtype} with unit last stride")
    if T == 0:
        return out
    if out.untyped_storage().data_ptr() in (x.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()):
        raise ValueError("out must not alias an input (contract 2)")
    has_lora = lora is not None and lora.a.shape[0] > 0
    cfg = config or default_lora_linear_config(T, n_in=n_in, n_out=n_out, has_lora=has_lora,
                                               row_plan=has_lora and lora.row_plan is not None)
    if cfg.mode == "splitk" and T <= _SPLITK_MAX_ROWS and x.dtype != torch.float32 and weight.stride(1) == 1:
        _splitk_linear(x, weight, bias, lora if has_lora else None, out, T, n_in, cfg)
        return out
    shrunk = None
    # the split path's shrink: split (and splitk past its rows), and planned with plan_shrink "split"
    own_shrink = cfg.mode in ("split", "splitk") or (cfg.mode == "planned" and cfg.plan_shrink == "split")
    if has_lora and own_shrink and side_stream is not None:
        # Fork (contract 2): the side stream reads x, A, the slots and ranks and writes only xa; the
        # GEMM here reads x and W and writes only `out`. Nothing read across the fork is written before
        # the join, and xa (allocated here before the fork) is read by the expand after it.
        shrunk = _shrink(x, lora, T, n_in, cfg, side_stream)
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)
    if not has_lora:
        return out
    if cfg.mode == "fused":
        _add_delta_fused(x, out, lora, T, n_in, n_out, cfg)
        return out
    if cfg.mode == "planned" and cfg.plan_shrink == "fused":
        _add_delta_planned(x, out, lora, T, n_out, cfg)
        return out
    if shrunk is None:
        shrunk = _shrink(x, lora, T, n_in, cfg)
    else:
        join(side_stream, x.device)  # xa is complete
    if cfg.mode == "planned":
        _add_delta_planned(x, out, lora, T, n_out, cfg, shrunk)
        return out
    _expand(out, lora, T, n_out, cfg, shrunk)
    return out
