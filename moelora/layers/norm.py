"""RMSNorm, alone or fused with the residual add before it.

Shape legend: [..., D] -> [..., D]; computed in fp32, returned in the input dtype.
`forward(x)` -> rms_norm(x); `add_forward(x, delta)` -> (h = x + delta, rms_norm(h)), the residual
stream of the decoder (delta None: h = x; a pair (a, b): h = x + (a + b), an MoE block's routed and shared
outputs, summed in the dtype first, in the same launch). Under backend "triton" either is one kernel launch
(`moelora.kernels.norm`); the torch path is `rms_norm_ref`, the semantics that kernel reproduces.

The weight stays fp32 whatever the model dtype; the product is cast back to the input dtype, which
for a bf16/fp16 checkpoint (weights exactly representable) equals transformers' product in that dtype."""

from __future__ import annotations

import torch
from torch import nn

from moelora.kernels.reference import rms_norm_ref

Delta = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None


def settle(delta: Delta) -> torch.Tensor | None:
    """A pair (a, b) as the one tensor a + b (what a consumer of one tensor reads); a tensor or None as it is."""
    return delta[0] + delta[1] if isinstance(delta, tuple) else delta


def _parts(delta: Delta) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(first delta, second or None) as [T, D] rows: a pair's two parts, a tensor alone, or (None, None)."""
    d, d2 = delta if isinstance(delta, tuple) else (delta, None)
    return (None if d is None else _rows(d)), (None if d2 is None else _rows(d2))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [T, D] with unit stride along D (a view where possible)."""
    if x.dim() == 2 and (x.stride(-1) == 1 or x.numel() == 0):
        return x
    return x.reshape(-1, x.shape[-1]).contiguous()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: str = "torch", pdl: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend
        self.pdl = pdl  # the Triton launches with programmatic dependent launch (`LayerOptions.pdl`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            from moelora.kernels.norm import rms_norm

            return rms_norm(_rows(x), self.weight, self.eps, pdl=self.pdl).view(x.shape)
        return rms_norm_ref(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: Delta) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, rms_norm(h)) with h = x + delta rounded to the dtype (x itself when delta is None; a pair (a, b):
        x + (a + b), a + b rounded first)."""
        if delta is None:
            return x, self(x)
        if self.backend == "triton":
            from moelora.kernels.norm import add_rms_norm

            d, d2 = _parts(delta)
            h, y = add_rms_norm(_rows(x), d, self.weight, self.eps, pdl=self.pdl, delta2=d2)
            return h.view(x.shape), y.view(x.shape)
        h = x + settle(delta)
        return h, rms_norm_ref(h, self.weight, self.eps)

    def add_forward_fp8(self, x: torch.Tensor, delta: Delta):
        """`add_forward` plus the normed rows quantized for W8A8 GEMMs in the same launch (`FP8Rows`; the Triton
        backend, x [T, D]): (h, y, rows)."""
        from moelora.kernels.norm import norm_fp8

        d, d2 = _parts(delta)
        return norm_fp8(x, d, self.weight, self.eps, pdl=self.pdl, delta2=d2)
