"""kv_b_proj's LoRA in MLA's absorbed decode: `layers.mla.absorb_query` / `expand_output`'s LoRA terms on the GPU.

Shape legend: T tokens, N heads, Dn qk_nope_head_dim, Dv v_head_dim, C kv_lora_rank, S slots, R max rank.
  kv_b_proj's slots: a [S, R, C], b [S, N (Dn + Dv), R] (head n: rows n (Dn + Dv) + [0, Dn) the key half
  uk, + [Dn, Dn + Dv) the value half uv), ranks [S] int32 (this site's own), token_slots [T] int32 (-1: none)
  absorb: q_abs[t, n] += (q_nope[t, n] B_s,uk[n]) A_s        q_nope [T, N, Dn], q_abs [T, N, C]
  expand: out[t, n]   += (o_lat[t, n] A_s^T) B_s,uv[n]^T     o_lat [T, N, C],   out [T, N, Dv]
Added in place into the caller's fresh q_abs / out, program (t, HB heads, output chunk), the [HB, R] intermediate
rounded as the torch path rounds it: one launch a side instead of the torch path's ~8.

Tiles (`tiles`, a table per side): decode's few rows take 1, 2 or 4 heads a program, the products summed in
registers, the fewest heads that keep the grid within the table's programs; more rows take 16 heads a program on
the tensor cores (tl.dot), their output columns (absorb: C, expand: Dv) split over up to 4 programs below ~128
programs. A 16-head program at one row walks C in 8 dependent steps: 10.6 / 4.6 us a side on the H200 where 1
head a program takes 3.1 / 3.5 (docs/performance.md). Neither the heads a program nor the split changes a
column's sum order (each step's width follows the rank tile and the heads only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.checks import cdiv, lora_tile_rank, next_pow2
from moelora.kernels.lora_tiles import rank_chunks
from moelora.kernels.pdl import pdl_args, pdl_wait

_HB = 16  # heads a program on the tensor cores: the rows of the tl.dot
_REG_HEADS = (1, 2, 4)  # heads a program summed in registers
# (heads a program, most programs in the grid): the first row that fits, else 16 heads on dots. The H200 sweep
# (benchmarks/mla_lora.py, DeepSeek-V2-Lite, docs/performance.md): 1 head up to 32 rows, 2 at 64; then the absorb
# side's 4 heads beat 16 up to 256 rows (14.4 vs 19.3 us), the expand side's 16 from 128 rows (8.1 vs 9.5 us).
_TILES = {"absorb": ((1, 512), (2, 512), (4, 1024)), "expand": ((1, 512), (2, 512))}
_BC = 64  # latent columns a step (16 heads)
_BCW = 256  # latent columns a step of the expand side's o_lat A^T (2 steps at C = 512; 128 past rank tile 32)
_MAX_SPLITS = 4  # output chunks of one (t, head block)
_FILL = 128  # programs in flight below which the output columns split (~ the H200's 132 SMs)


def default_splits(T: int, N: int) -> int:
    """Output chunks a (token, 16-head block) program pair splits into: enough to put ~_FILL programs in flight."""
    return max(1, min(_MAX_SPLITS, _FILL // max(1, T * cdiv(N, _HB))))


def tiles(T: int, N: int, side: str) -> tuple[int, int]:
    """(heads a program, output splits) of `side` ("absorb" / "expand") for T rows of N heads (`_TILES`)."""
    for hb, programs in _TILES[side]:
        if T * cdiv(N, hb) <= programs:
            return hb, 1
    return _HB, default_splits(T, N)


def _head_columns(block_r: int) -> int:
    """Dn / Dv columns a step: 32 at rank tile 16, else the widest not spilling on sm_90 (docs/performance.md)."""
    return 32 if block_r <= 16 else max(1, 256 // block_r)


def _reg_columns(hb: int, block_r: int, cols: int) -> int:
    """Columns a register-sum step of hb heads: the [hb, step, R] product as large as 16 heads' (`_head_columns`),
    at most the next power of two of `cols`."""
    return min(next_pow2(max(cols, 1)), _head_columns(block_r) * _HB // hb)


@triton.jit
def _program_rows(slots_ptr, ranks_ptr, N, HB: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (t, head block): (t, its slot, that slot's rank here (0: none), heads, their mask, rank cols, mask)."""
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    rank = tl.where(s >= 0, tl.load(ranks_ptr + tl.maximum(s, 0)), 0)
    offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
    offs_r = tl.arange(0, BLOCK_R)
    return t, s, rank, offs_h, offs_h < N, offs_r, offs_r < rank


@triton.jit
def _b_heads(b_s, rows, m, offs_r, rank, stride_bn):
    """[HB, DC, BLOCK_R] of B_s in whole 16-column rank chunks (vector loads), columns past the rank zeroed."""
    bt = tl.load(b_s + rows[:, :, None].to(tl.int64) * stride_bn + offs_r[None, None, :],
                 mask=m[:, :, None] & (offs_r < rank_chunks(rank, stride_bn))[None, None, :], other=0.0)
    return tl.where((offs_r < rank)[None, None, :], bt, 0.0)


@triton.jit
def _absorb_lora_kernel(q_ptr, qa_ptr, a_ptr, b_ptr, slots_ptr, ranks_ptr, N, C, C_CHUNK, stride_qt, stride_qn,
                        stride_at, stride_an, stride_as, stride_ar, stride_bs, stride_bn,
                        DN: tl.constexpr, DV: tl.constexpr, HB: tl.constexpr, BLOCK_R: tl.constexpr,
                        DC: tl.constexpr, BC: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_wait(PDL)
    t, s, rank, offs_h, h_ok, offs_r, r_ok = _program_rows(slots_ptr, ranks_ptr, N, HB, BLOCK_R)
    if rank > 0:
        b_s = b_ptr + s.to(tl.int64) * stride_bs
        u = tl.zeros((HB, BLOCK_R), tl.float32)
        for d0 in tl.static_range(0, DN, DC):  # u[n] = q_nope[t, n] B_s,uk[n]: a [DC, R] tile of each head
            offs_d = d0 + tl.arange(0, DC)
            m = h_ok[:, None] & (offs_d < DN)[None, :]
            q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qn + offs_d[None, :], mask=m,
                        other=0.0)
            rows = offs_h[:, None] * (DN + DV) + offs_d[None, :]
            bt = _b_heads(b_s, rows, m, offs_r, rank, stride_bn)
            u += tl.sum(q.to(tl.float32)[:, :, None] * bt.to(tl.float32), axis=1)
        u = u.to(qa_ptr.dtype.element_ty)
        a_s = a_ptr + s.to(tl.int64) * stride_as
        c_lo = tl.program_id(2) * C_CHUNK  # this program's latent columns [c_lo, c_lo + C_CHUNK)
        for c0 in range(c_lo, tl.minimum(C, c_lo + C_CHUNK), BC):
            offs_c = c0 + tl.arange(0, BC)
            c_ok = offs_c < C
            at = tl.load(a_s + offs_r[:, None] * stride_ar + offs_c[None, :], mask=r_ok[:, None] & c_ok[None, :],
                         other=0.0)
            ptrs = qa_ptr + t.to(tl.int64) * stride_at + offs_h[:, None] * stride_an + offs_c[None, :]
            mc = h_ok[:, None] & c_ok[None, :]
            if DOT:
                d = tl.dot(u, at.to(u.dtype), input_precision=PRECISION)
            else:  # [HB, R, BC] in registers: too few heads for a dot's 16 rows
                d = tl.sum(u.to(tl.float32)[:, :, None] * at.to(tl.float32)[None, :, :], axis=1)
            y = tl.load(ptrs, mask=mc, other=0.0).to(tl.float32) + d
            tl.store(ptrs, y.to(qa_ptr.dtype.element_ty), mask=mc)


@triton.jit
def _expand_lora_kernel(ol_ptr, out_ptr, a_ptr, b_ptr, slots_ptr, ranks_ptr, N, C, stride_lt, stride_ln, stride_yt,
                        stride_yn, stride_as, stride_ar, stride_bs, stride_bn,
                        DN: tl.constexpr, DV: tl.constexpr, HB: tl.constexpr, BLOCK_R: tl.constexpr,
                        DC: tl.constexpr, BC: tl.constexpr, V_CHUNK: tl.constexpr, DOT: tl.constexpr,
                        PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t, s, rank, offs_h, h_ok, offs_r, r_ok = _program_rows(slots_ptr, ranks_ptr, N, HB, BLOCK_R)
    if rank > 0:
        a_s = a_ptr + s.to(tl.int64) * stride_as
        w = tl.zeros((HB, BLOCK_R), tl.float32)
        for c0 in range(0, C, BC):  # w[n] = o_lat[t, n] A_s^T (BC: the launcher's wider step, fewer in a row)
            offs_c = c0 + tl.arange(0, BC)
            c_ok = offs_c < C
            o = tl.load(ol_ptr + t.to(tl.int64) * stride_lt + offs_h[:, None] * stride_ln + offs_c[None, :],
                        mask=h_ok[:, None] & c_ok[None, :], other=0.0)
            at = tl.load(a_s + offs_r[None, :] * stride_ar + offs_c[:, None], mask=r_ok[None, :] & c_ok[:, None],
                         other=0.0)
            if DOT:
                w = tl.dot(o, at.to(o.dtype), w, input_precision=PRECISION)
            else:  # [HB, BC, R] in registers
                w += tl.sum(o.to(tl.float32)[:, :, None] * at.to(tl.float32)[None, :, :], axis=1)
        w = w.to(out_ptr.dtype.element_ty).to(tl.float32)
        b_s = b_ptr + s.to(tl.int64) * stride_bs
        v_lo = tl.program_id(2) * V_CHUNK  # this program's value columns [v_lo, v_lo + V_CHUNK)
        for v0 in tl.static_range(0, V_CHUNK, DC):  # out[t, n] += w[n] B_s,uv[n]^T: a [DC, R] tile of each head
            offs_v = v_lo + v0 + tl.arange(0, DC)
            m = h_ok[:, None] & (offs_v < DV)[None, :]
            rows = offs_h[:, None] * (DN + DV) + DN + offs_v[None, :]
            bt = _b_heads(b_s, rows, m, offs_r, rank, stride_bn)
            ptrs = out_ptr + t.to(tl.int64) * stride_yt + offs_h[:, None] * stride_yn + offs_v[None, :]
            y = tl.load(ptrs, mask=m, other=0.0).to(tl.float32) + tl.sum(w[:, None, :] * bt.to(tl.float32), axis=2)
            tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=m)


def _check(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
           slots: torch.Tensor, nope: int, latent_in: bool) -> tuple[int, int, int, str]:
    """(T, N, Dv, dot precision) after checking x [T, N, Dn] -> y [T, N, C] (latent_in: [T, N, C] -> [T, N, Dv])."""
    T, N = x.shape[:2]
    S, R, C = a.shape
    if b.dim() != 3 or b.shape[0] != S or b.shape[2] != R or b.shape[1] % max(N, 1) or b.shape[1] // max(N, 1) <= nope:
        raise ValueError(f"b must be [S={S}, N={N} x (Dn={nope} + Dv), R={R}], got {tuple(b.shape)}")
    dv = b.shape[1] // N - nope
    for name, t, last in (("input", x, C if latent_in else nope), ("output", y, dv if latent_in else C)):
        if t.dim() != 3 or tuple(t.shape) != (T, N, last) or t.stride(2) != 1:
            raise ValueError(f"{name} must be [{T}, {N}, {last}] with unit last stride, got {tuple(t.shape)}")
    if x.dtype != y.dtype or a.dtype != b.dtype or a.stride(2) != 1 or b.stride(2) != 1 or b.stride(1) != R:
        raise ValueError("input and output must share a dtype; a and b one, unit last strides, b's rows R apart")
    if tuple(ranks.shape) != (S,) or ranks.dtype != torch.int32 or tuple(slots.shape) != (T,) \
            or slots.dtype != torch.int32:
        raise ValueError(f"ranks must be [S={S}] and token_slots [T={T}], int32")
    return T, N, dv, "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def mla_absorb_lora_(q_abs: torch.Tensor, q_nope: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     ranks: torch.Tensor, token_slots: torch.Tensor, width: int | None = None, *,
                     heads: int | None = None, splits: int | None = None, pdl: bool = False) -> torch.Tensor:
    """q_abs [T, N, C] += (q_nope B_s,uk) A_s in place, returned; `width`: `LoRABatch.max_rank`; `heads` a
    program (1, 2, 4 or 16) and `splits` of C: default `tiles`' (the result does not depend on either); `pdl`:
    programmatic dependent launch where the GPU has it (`kernels.pdl`)."""
    nope = q_nope.shape[2]
    T, N, dv, precision = _check(q_nope, q_abs, a, b, ranks, token_slots, nope, latent_in=False)
    block_r = lora_tile_rank(a.shape[1], width)
    C = a.shape[2]
    hb, splits = _pick(T, N, "absorb", heads, splits)
    dc, bc = (_head_columns(block_r), _BC) if hb == _HB else (_reg_columns(hb, block_r, nope),
                                                              _reg_columns(hb, block_r, C))
    chunk = cdiv(cdiv(C, splits), bc) * bc
    if T:
        _absorb_lora_kernel[(T, cdiv(N, hb), cdiv(C, chunk))](
            q_nope, q_abs, a, b, token_slots, ranks, N, C, chunk, q_nope.stride(0), q_nope.stride(1),
            q_abs.stride(0), q_abs.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), DN=nope, DV=dv,
            HB=hb, BLOCK_R=block_r, DC=dc, BC=bc, DOT=hb == _HB, PRECISION=precision, num_warps=4,
            **pdl_args(pdl, q_nope))
    return q_abs


def mla_expand_lora_(out: torch.Tensor, o_lat: torch.Tensor, a: torch.Tensor, b: torch.Tensor, nope: int,
                     ranks: torch.Tensor, token_slots: torch.Tensor, width: int | None = None, *,
                     heads: int | None = None, splits: int | None = None, pdl: bool = False) -> torch.Tensor:
    """out [T, N, Dv] += (o_lat [T, N, C] A_s^T) B_s,uv^T in place (see the module docstring); returns out;
    `heads`, `splits` (of Dv) and `pdl`: as `mla_absorb_lora_`'s."""
    T, N, dv, precision = _check(o_lat, out, a, b, ranks, token_slots, nope, latent_in=True)
    block_r = lora_tile_rank(a.shape[1], width)
    C = a.shape[2]
    hb, splits = _pick(T, N, "expand", heads, splits)
    dc, bc = (_head_columns(block_r), _BCW if block_r <= 32 else _BCW // 2) if hb == _HB else \
        (_reg_columns(hb, block_r, dv), _reg_columns(hb, block_r, C))
    chunk = cdiv(cdiv(dv, splits), dc) * dc
    if T:
        _expand_lora_kernel[(T, cdiv(N, hb), cdiv(dv, chunk))](
            o_lat, out, a, b, token_slots, ranks, N, C, o_lat.stride(0), o_lat.stride(1), out.stride(0),
            out.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), DN=nope, DV=dv, HB=hb,
            BLOCK_R=block_r, DC=dc, BC=bc, V_CHUNK=chunk, DOT=hb == _HB, PRECISION=precision, num_warps=4,
            **pdl_args(pdl, o_lat))
    return out


def _pick(T: int, N: int, side: str, heads: int | None, splits: int | None) -> tuple[int, int]:
    """(heads a program, splits): the caller's where given, else `tiles`' (register sums: no split)."""
    if heads is not None and heads not in (*_REG_HEADS, _HB):
        raise ValueError(f"heads a program must be one of {(*_REG_HEADS, _HB)}, got {heads}")
    hb = heads or tiles(T, N, side)[0]
    return hb, splits or (default_splits(T, N) if hb == _HB else 1)
