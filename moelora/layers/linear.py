"""Linear layers with their own multi-LoRA delta (contract 1: LoRA is part of the layer).

Shape legend: T tokens, N_in / N_out features, S adapter slots, R max rank, G output segments.
Slot buffers `lora_a [S, R, N_in]`, `lora_b [S, N_out, R]` and `lora_ranks [S]` int32 have a
fixed address for the model's lifetime (CUDA graphs capture them); loading an adapter copies into
a slot, unloading zeroes it. A slot the adapter does not cover at this site stays zero.

`lora_ranks` is this site's own rank per slot (0: the slot is empty or its adapter has no LoRA
here), and it is what the kernels read (`DenseLoRAArgs.slot_ranks`), not the adapter's global
rank: a site an adapter does not cover (e.g. the router `mlp.gate`) then costs no LoRA work. The
torch twin loops over `LoRABatch.active` with the host-side global rank instead (reading the device
ranks would sync); that is exact, as columns beyond a site's own rank are zero.

`MergedLinear` is G linears over the same input as one (attention's q/k/v): weight
[N_out = sum N_g, N_in] (one GEMM), `lora_a [S, G*R, N_in]` (segment g: rows [gR, gR + R)),
`lora_b [S, N_out, R]` (segment g: its output rows), `lora_ranks [G, S]`; its LoRA delta is one
shrink and one expand launch (`DenseLoRAArgs.segments`). Each segment is still a site and a
checkpoint name of its own: a `LinearSegment` (e.g. `self_attn.q_proj`) whose weight, bias and
LoRA buffers are views into the merged ones, taken on every access (so they follow `.to()`), and
which saves and loads `q_proj.weight` / `q_proj.bias` in `state_dict()` / `load_state_dict()`; the
merged module itself has no state-dict keys.

FP8 (`quant`, an `FP8Config`; contract 10): the weight is e4m3 with its `weight_scale_inv` (block
[sum_g ceil(N_g/128), ceil(N_in/128)], each segment blocked on its own, or per row [N_out, 1]:
`moelora.quant.storage`); the Triton backend runs the FP8 GEMM on it (`kernels/fp8_linear.py`: W8A8 when
the config quantizes activations, else W8A16), the torch twin reads `dense_weight(dtype)`, the dequantized
transient; the LoRA slots and kernels are the same as in bf16.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import replace

import torch
from torch import nn

from moelora.kernels.args import DenseLoRAArgs, FP8Rows, split_k_counters
from moelora.kernels.dense_policy import DENSE_LORA_POLICY, DenseLoRAPolicy
from moelora.kernels.reference import lora_linear_ref
from moelora.layers.options import DEFAULT_OPTIONS, LayerOptions
from moelora.lora.adapter import LoRAWeights
from moelora.lora.batch import LoRABatch
from moelora.quant.config import FP8Config
from moelora.quant.storage import activation_quantizer, dense_weight, fp8_parameters, scale_rows


def _project(backend: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             args: DenseLoRAArgs | None, side_stream: torch.cuda.Stream | None, act_quant=None,
             policy: DenseLoRAPolicy = DENSE_LORA_POLICY, pdl: bool = False) -> torch.Tensor:
    if backend == "triton":  # bf16 weights (FP8 ones: `_FP8Weight._project`)
        from moelora.kernels.lora_linear import lora_linear

        return lora_linear(x, weight, bias, args, side_stream=side_stream, policy=policy, pdl=pdl)
    return lora_linear_ref(x, weight, bias, args, act_quant)


class _FP8Weight:
    """The GEMM weight of a dense site or merged projection: the parameter, or an FP8 one dequantized."""

    quant: FP8Config | None = None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.quant is None:
            return self.weight
        return dense_weight(self.weight, self.weight_scale_inv, self.quant, self.scale_segments, dtype)

    def fp8_weights(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(weight, scale, row segments) of this module's FP8 parameters (`quant.storage.fp8_weight_sites`)."""
        return [("weight", "weight_scale_inv", self.scale_segments)]

    def _project(self, x: torch.Tensor, lora: LoRABatch | None, x_fp8: FP8Rows | None = None) -> torch.Tensor:
        """x W^T + b + the LoRA delta of `lora` (its side stream, if any, runs the LoRA shrink); `x_fp8`: x
        quantized for W8A8 by the kernel that wrote it (read by the Triton FP8 path only)."""
        return self._project_args(x, self.lora_args(lora), None if lora is None else lora.side_stream, x_fp8)

    def _project_args(self, x: torch.Tensor, args: DenseLoRAArgs | None, side: torch.cuda.Stream | None,
                      x_fp8: FP8Rows | None = None) -> torch.Tensor:
        """`_project` on LoRA arguments given (`lora_args`, or rows' own slots: `LinearSite.forward_rows`)."""
        if self.quant is not None and self.options.kernel_backend == "triton":
            from moelora.kernels.fp8_linear import fp8_lora_linear

            return fp8_lora_linear(x, self.weight, self.weight_scale_inv, self.bias, args,
                                   segments=self.scale_segments, block=self.quant.weights == "block",
                                   quantize_activations=activation_quantizer(self.quant) is not None,
                                   side_stream=side, x_fp8=x_fp8, counters=self.split_k_counters,
                                   pdl=self.options.pdl)
        return _project(self.options.kernel_backend, x, self.dense_weight(x.dtype), self.bias, args, side,
                        activation_quantizer(self.quant), self.options.dense_lora_policy, self.options.pdl)


class LinearSite(_FP8Weight, nn.Module):
    """A dense LoRA site: y = x W^T + b + its LoRA delta. Subclasses provide `weight` [N_out, N_in],
    `bias`, `lora_a` [S, R, N_in], `lora_b` [S, N_out, R], `lora_ranks` [S], `has_lora`, `options`,
    `in_features` and `out_features`."""

    def set_lora_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Copy `weights` (a [r, N_in], b [N_out, r]) into `slot` and set its site rank to r, or
        zero the slot and its rank. Runs between steps (adapter load / eviction), never in a graph."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        r = 0 if weights is None else weights.rank
        if r:
            self.lora_a[slot, :r].copy_(weights.a, non_blocking=True)
            self.lora_b[slot, :, :r].copy_(weights.b, non_blocking=True)
        self.lora_ranks[slot] = r

    @property
    def lora_owner(self) -> nn.Module:
        """The module owning this site's slot buffers (a `LoRABatch.idle` member while no registered
        adapter has weights there)."""
        return self

    def lora_args(self, lora: LoRABatch | None) -> DenseLoRAArgs | None:
        if lora is None or not self.has_lora or lora.skips(self.lora_owner):
            return None
        return DenseLoRAArgs(self.lora_a, self.lora_b, lora.token_slots, self.lora_ranks, lora.active,
                             row_plan=lora.row_plan, width=lora.max_rank, slots=lora.slots)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None, x_fp8: FP8Rows | None = None) -> torch.Tensor:
        return self._project(x, lora, x_fp8)

    def forward_rows(self, x: torch.Tensor, slots: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """x W^T + b + each row's LoRA delta, row i on adapter slot `slots[i]` ([rows] int32 on x's device, -1:
        none): rows outside the step that carry a request's adapter (an MLA layer's cached latents, expanded
        through kv_b_proj at read time), with no host sync; `lora`: the step's batch (None or skipping this site:
        no delta). Triton: the dense LoRA kernels on these rows' slots (bounded by the step's ranks); torch (the
        twin): every slot's delta in one matmul a side, the row's own kept by a one-hot mask (columns beyond a
        slot's rank are zero; a one-segment site, as kv_b_proj)."""
        if lora is None or not self.has_lora or lora.skips(self.lora_owner):
            return self.forward(x)
        if self.options.kernel_backend == "triton":
            return self._project_args(x, replace(self.lora_args(lora), token_slots=slots, active=None, row_plan=None,
                                                    slots=None),
                                      None)
        S, R, n_in = self.lora_a.shape
        onehot = (slots[:, None] == torch.arange(S, device=slots.device)).to(x.dtype)  # [rows, S]
        xa = (x @ self.lora_a.reshape(S * R, n_in).t().to(x.dtype)).view(-1, S, R) * onehot[:, :, None]
        return self.forward(x) + xa.view(-1, S * R) @ self.lora_b.transpose(1, 2).reshape(S * R, -1).to(x.dtype)


class Linear(LinearSite):
    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 max_loras: int = 0, max_rank: int = 0, options: LayerOptions = DEFAULT_OPTIONS,
                 dtype: torch.dtype | None = None, quant: FP8Config | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.options, self.quant, self.scale_segments = options, quant, (out_features,)
        if quant is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        else:
            self.weight, self.weight_scale_inv = fp8_parameters(quant, self.scale_segments, in_features)
            self.register_buffer("split_k_counters", split_k_counters(out_features), persistent=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.has_lora = max_loras > 0 and max_rank > 0
        if self.has_lora:
            self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, in_features, dtype=dtype),
                                 persistent=False)
            self.register_buffer("lora_b", torch.zeros(max_loras, out_features, max_rank, dtype=dtype),
                                 persistent=False)
            self.register_buffer("lora_ranks", torch.zeros(max_loras, dtype=torch.int32), persistent=False)


class MergedLinear(_FP8Weight, nn.Module):
    """G linears over one input, `out_sizes` (N_0, .., N_{G-1}): forward -> y [T, sum N_g], one GEMM
    and one LoRA shrink + expand. Its segments (`segments`) are the sites and checkpoint names; the
    owner registers them as its own children under their names (see `Attention`)."""

    def __init__(self, in_features: int, out_sizes: tuple[int, ...], *, bias: bool = False,
                 max_loras: int = 0, max_rank: int = 0, options: LayerOptions = DEFAULT_OPTIONS,
                 dtype: torch.dtype | None = None, quant: FP8Config | None = None):
        super().__init__()
        self.in_features, self.out_sizes = in_features, tuple(out_sizes)
        self.out_features = sum(self.out_sizes)
        self.bounds = tuple(itertools.accumulate(self.out_sizes, initial=0))
        self.options, self.max_rank = options, max_rank
        self.quant, self.scale_segments = quant, self.out_sizes
        if quant is None:
            self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype))
        else:
            self.weight, self.weight_scale_inv = fp8_parameters(quant, self.out_sizes, in_features)
            self.register_buffer("split_k_counters", split_k_counters(self.out_features), persistent=False)
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype)) if bias else None
        self.has_lora = max_loras > 0 and max_rank > 0
        G = len(self.out_sizes)
        if self.has_lora:
            self.register_buffer("lora_a", torch.zeros(max_loras, G * max_rank, in_features, dtype=dtype),
                                 persistent=False)
            self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_rank, dtype=dtype),
                                 persistent=False)
            self.register_buffer("lora_ranks", torch.zeros(G, max_loras, dtype=torch.int32), persistent=False)
        self.segments = tuple(LinearSegment(self, g) for g in range(G))

    def lora_args(self, lora: LoRABatch | None) -> DenseLoRAArgs | None:
        if lora is None or not self.has_lora or lora.skips(self):
            return None
        return DenseLoRAArgs(self.lora_a, self.lora_b, lora.token_slots, self.lora_ranks, lora.active,
                             self.out_sizes, lora.row_plan, width=lora.max_rank, slots=lora.slots)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None, x_fp8: FP8Rows | None = None) -> torch.Tensor:
        return self._project(x, lora, x_fp8)

    # The segments save and load the weights under their own names.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix))


class LinearSegment(LinearSite):
    """Output segment g of a `MergedLinear` as a site of its own: weight [N_g, N_in], bias [N_g],
    lora_a [S, R, N_in], lora_b [S, N_g, R] and lora_ranks [S] are views into the merged tensors.
    `forward` runs this segment alone (three of them: the unmerged q/k/v path)."""

    def __init__(self, merged: MergedLinear, index: int):
        super().__init__()
        # a weak reference: the owner registers both modules, and no cycle keeps a dropped model's weights
        object.__setattr__(self, "_merged", weakref.ref(merged))
        self.index = index
        self.in_features, self.out_features = merged.in_features, merged.out_sizes[index]
        self.has_lora, self.options = merged.has_lora, merged.options
        self._rows = slice(merged.bounds[index], merged.bounds[index + 1])
        self.quant, self.scale_segments = merged.quant, (self.out_features,)
        self._scale_rows = None if self.quant is None else scale_rows(self.quant, merged.out_sizes, index)

    @property
    def merged(self) -> MergedLinear:
        return self._merged()

    @property
    def lora_owner(self) -> nn.Module:
        return self.merged

    @property
    def weight(self) -> torch.Tensor:
        return self.merged.weight[self._rows]

    @property
    def weight_scale_inv(self) -> torch.Tensor:
        return self.merged.weight_scale_inv[self._scale_rows]

    @property
    def split_k_counters(self) -> torch.Tensor:  # the merged projection's: its segments run one at a time
        return self.merged.split_k_counters

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.merged.bias is None else self.merged.bias[self._rows]

    @property
    def lora_a(self) -> torch.Tensor:
        R = self.merged.max_rank
        return self.merged.lora_a[:, self.index * R:(self.index + 1) * R]

    @property
    def lora_b(self) -> torch.Tensor:
        return self.merged.lora_b[:, self._rows]

    @property
    def lora_ranks(self) -> torch.Tensor:
        return self.merged.lora_ranks[self.index]

    def _checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        scale = {} if self.quant is None else {"weight_scale_inv": self.weight_scale_inv}
        return {"weight": self.weight} | scale | ({} if self.bias is None else {"bias": self.bias})

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, t in self._checkpoint_tensors().items():
            destination[prefix + name] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        own = self._checkpoint_tensors()
        for name, dest in own.items():
            key = prefix + name
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            src = state_dict[key]
            if src.shape != dest.shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {src.shape} from "
                                  f"checkpoint, the shape in current model is {dest.shape}.")
                continue
            with torch.no_grad():
                dest.copy_(src)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in own)
