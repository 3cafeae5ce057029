"""The protocol every routed-LoRA path of `fused_moe` follows, and the call it serves.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, S adapter slots, R max rank,
BLOCK_R the LoRA tile rank, P plan rows (max_padded), BM plan block_m.
A path adds its LoRA to the base pipeline (plan -> gate_up -> activation -> down -> combine) through hooks
called in class order: `__init__` allocates its scratch on the current stream before any fork (contract 2);
`gate_up_out(h)` is where gate_up writes (h [P, I] activated, or a raw [P, 2I] gate / up buffer);
`before_gate_up`, `after_gate_up(gu, h)`, `before_down(h)`, `before_combine` launch what runs between the
kernels (a shrink, a delta, a fork or join, an activation); `*_args` are the kernels' LoRA arguments and flags.
The base class is the no-LoRA path: every flag off, dummies for every pointer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.kernels.args import ExpertLoRAArgs, MoERoutingPlan

LORA_RC = 16  # rank columns per step of a chunked shrink / expand: cost follows each slot's own rank


@dataclass(frozen=True)
class MoECall:
    """One fused_moe call, as its LoRA path sees it."""

    x: torch.Tensor  # [T, H]
    plan: MoERoutingPlan
    topk_ids: torch.Tensor  # [T, K]
    lora: ExpertLoRAArgs | None
    block_r: int  # the LoRA tile rank (`checks.lora_tile_rank`)
    inter: int  # I
    gate_up_bn: int  # the gate_up GEMM's output columns a program
    side_stream: torch.cuda.Stream | None
    pdl: bool = False  # every launch of the path with programmatic dependent launch (`kernels.pdl`)

    @property
    def n_slots(self) -> int:
        return self.lora.gate_up_a.shape[0] if self.lora is not None else 0

    @property
    def rows(self) -> int:
        return self.plan.sorted_route_ids.shape[0]


class MoELoRAPath:
    """The no-LoRA path; a registered path overrides what it adds (see the module docstring)."""

    name = "none"
    # What benchmarks/tune_fused_moe.py times (scripts/compile_check.py compiles each): `trials(block_m)` on a
    # table entry's tiles, then each change of `refinements` on the pick, kept if faster.
    refinements: tuple[dict, ...] = ()

    @classmethod
    def trials(cls, block_m: int) -> list:
        return []

    @classmethod
    def resolve(cls, cfg, n_slots: int, block_r: int) -> tuple[type[MoELoRAPath], object]:
        """(path class, config) that serves cfg for a pool of n_slots slots of block_r tile columns."""
        return cls, cfg

    def __init__(self, call: MoECall, cfg=None):
        self.call = call
        self.cfg = cfg

    def gate_up_out(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def before_gate_up(self) -> None:
        pass

    def gate_up_args(self) -> dict:
        return {**self._gemm_args("gate_up"), **self._delta_args(None), "RAW_OUT": False, "SPREAD": False,
                "spread_k": 0}

    def after_gate_up(self, gu_out: torch.Tensor, h: torch.Tensor) -> None:
        pass

    def before_down(self, h: torch.Tensor) -> None:
        pass

    def down_args(self) -> dict:
        return self._gemm_args("down")

    def before_combine(self) -> None:
        pass

    def combine_args(self) -> dict:
        x = self.call.x
        return dict(delta_ptr=x, slots_ptr=x, ranks_ptr=x, stride_dr=x.stride(0), HAS_DELTA=False)

    # the GEMM kernels' LoRA arguments, flags off: paths replace the ones they use
    def _gemm_args(self, which: str) -> dict:
        x = self.call.x
        return dict(lora_weights(self.call.lora, x, which), xa_ptr=x, XA_SPLIT=1, stride_xa=x.stride(0),
                    HAS_LORA=False, STACKED=False, n_slots=self.call.n_slots, S_P2=1, BLOCK_R=self.call.block_r,
                    LORA_BK=128, LORA_RC=LORA_RC)

    def _delta_args(self, delta: torch.Tensor | None) -> dict:
        """The gate_up kernel's per-route delta (LORA_DELTA: added in its epilogue)."""
        d = self.call.x if delta is None else delta
        return dict(delta_ptr=d, stride_dr=d.stride(0), LORA_DELTA=delta is not None)


class ShrinkFirst(MoELoRAPath):
    """A path whose shrink kernel runs before each GEMM and whose GEMM epilogues expand."""

    def _shrink(self, src: torch.Tensor, which: str, gather: bool) -> None:
        raise NotImplementedError

    def _epilogue(self) -> dict:
        raise NotImplementedError

    def before_gate_up(self) -> None:
        self._shrink(self.call.x, "gate_up", True)

    def gate_up_args(self) -> dict:
        return {**super().gate_up_args(), **self._epilogue()}

    def before_down(self, h: torch.Tensor) -> None:
        self._shrink(h, "down", False)

    def down_args(self) -> dict:
        return {**super().down_args(), **self._epilogue()}


def lora_weights(lora: ExpertLoRAArgs | None, dummy: torch.Tensor, which: str) -> dict:
    """Pointer and stride arguments of one projection's LoRA (gate_up or down); dummies without LoRA."""
    if lora is None:
        return dict(slots_ptr=dummy, ranks_ptr=dummy, a_ptr=dummy, b_ptr=dummy, stride_as=0, stride_ae=0,
                    stride_ar=0, stride_bs=0, stride_be=0, stride_bn=0)
    a, b = getattr(lora, f"{which}_a"), getattr(lora, f"{which}_b")
    return dict(slots_ptr=lora.token_slots, ranks_ptr=getattr(lora, f"{which}_ranks"), a_ptr=a, b_ptr=b,
                stride_as=a.stride(0), stride_ae=a.stride(1), stride_ar=a.stride(2),
                stride_bs=b.stride(0), stride_be=b.stride(1), stride_bn=b.stride(2))


def site(lora: ExpertLoRAArgs, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, B, ranks) of one projection."""
    return getattr(lora, f"{which}_a"), getattr(lora, f"{which}_b"), getattr(lora, f"{which}_ranks")
