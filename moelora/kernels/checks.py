"""Launcher argument checks shared by the kernels.

A launcher raises ValueError naming the argument, what it wanted and what it got; an `out=` must have the
output's shape and dtype, a unit last stride, and share no storage with an input (contract 2).
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host ints, without its constexpr-call cost (microseconds a call: docs/performance.md)."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """`triton.next_power_of_2` for host ints (>= 0; 0 -> 0, as Triton's), without its constexpr-call cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def need(cond: bool, msg) -> None:
    """Raise ValueError(msg) unless cond; msg a string or a callable making it (formatted only on failure)."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def need_pow2(owner: str, **blocks: int) -> None:
    """Each block size a power of two >= 16 (the smallest tl.dot operand)."""
    for name, v in blocks.items():
        if v < 16 or v & (v - 1):
            raise ValueError(f"{owner}.{name} must be a power of two >= 16 (tl.dot), got {v}")


def need_at_least(owner: str, minimum: int, **values: int) -> None:
    for name, v in values.items():
        if v < minimum:
            raise ValueError(f"{owner}.{name} must be >= {minimum}, got {v}")


def need_one_of(owner: str, name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {allowed}, got {value!r}")


def lora_tile_rank(pool_rank: int, width: int | None) -> int:
    """BLOCK_R of a LoRA launch: the pool's rank, or the smaller `width` (`LoRABatch.max_rank`, a host bound on the
    rows' slot ranks), as a power of two >= 16. A width below a slot's rank drops its columns: never guess it."""
    if width is not None and width < 0:
        raise ValueError(f"LoRA width must be None or >= 0, got {width}")
    r = pool_rank if width is None else min(pool_rank, width)
    return max(16, 1 << max(0, r - 1).bit_length())


def check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None,
               dtype: torch.dtype | None = None) -> None:
    """A float activation of `shape` (any row stride) with unit stride in its last dim."""
    if not (t.dtype in FLOAT_DTYPES if dtype is None else t.dtype == dtype):
        raise ValueError(f"{name} must be {dtype or 'fp16/bf16/fp32'}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {tuple(shape)}, got {tuple(t.shape)}")
    need(t.numel() == 0 or t.stride(-1) == 1, f"{name} must have unit stride in its last dim")


def check_vector(name: str, t: torch.Tensor, n: int, device: torch.device) -> None:
    if not (tuple(t.shape) == (n,) and t.is_floating_point()):
        raise ValueError(f"{name} must be a float [{n}], got {tuple(t.shape)} {t.dtype}")
    if not (t.device == device and t.is_contiguous()):
        raise ValueError(f"{name} must be contiguous on {device}")


def output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           inputs: tuple[torch.Tensor | None, ...], name: str = "out") -> torch.Tensor:
    """The caller's `out` after checking it, or a new contiguous tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not (tuple(out.shape) == tuple(shape) and out.dtype == dtype and out.device == device):
        raise ValueError(f"{name} must be {tuple(shape)} {dtype} on {device}, got {tuple(out.shape)} {out.dtype} "
                         f"on {out.device}")
    need(out.numel() == 0 or out.stride(-1) == 1, f"{name} must have unit stride in its last dim")
    if out.numel():
        ptr = out.untyped_storage().data_ptr()
        need(all(t is None or t.numel() == 0 or t.untyped_storage().data_ptr() != ptr for t in inputs),
             f"{name} must not alias an input (share its storage: contract 2)")
    return out
