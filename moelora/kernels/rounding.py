"""`round_to(v, like_ptr)`: fp32 values rounded (to nearest, ties to even) to the dtype `like_ptr` points to, back
in fp32, the way torch rounds each elementwise op's result.

Why not `v.to(dtype).to(tl.float32)`: compiled for the H200 (Triton 3.6), a bf16 round trip of that form is folded
away, and the product it rounded then fuses with the next addition into an fma: the rotary kernels differed from
torch's bf16 ops by one bf16 rounding in ~26% of the elements (measured, 2026-12-03). The bf16 rounding here is
integer arithmetic on the bits, which no float folding touches; fp16 and fp32 keep the casts (fp16's bit-exact
GPU tests pass). NaN inputs are not kept NaN (none reach these kernels: rotary and norm outputs).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(v, like_ptr):
    """v (fp32) rounded to `like_ptr`'s element dtype, back in fp32."""
    if like_ptr.dtype.element_ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return v.to(like_ptr.dtype.element_ty).to(tl.float32)
