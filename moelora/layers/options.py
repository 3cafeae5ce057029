"""`LayerOptions`: the fast-path picks of a model's layers, fixed when the model is built.

The model's constructor takes one and hands it to every layer's constructor (contract 8: options reach a
layer through its constructor, and nothing sets them later), so a layer runs with the options its model
was built with: an engine's `EngineConfig.layer_options()` (`build_engine`, a parallel rank's
`build_rank_model`), or `LayerOptions()` (the torch twins; what a model built by hand gets). An engine
refuses a model built with other options than its config's; `MoECausalLM.with_options` builds a twin that
shares the model's weights and LoRA slots (tests and benchmarks run one model under several configs).

The LoRA side stream (`EngineConfig.overlap_lora`) is no option: a CUDA stream is a runtime resource, made by
the runner and handed to the layers with each step's `LoRABatch` (`side_stream`), next to the rows it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moelora.errors import ConfigError
from moelora.kernels.dense_policy import DENSE_LORA_POLICY, DenseLoRAPolicy

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class LayerOptions:
    kernel_backend: str = "torch"  # "torch": the twins (kernels/reference.py); "triton": the kernels
    fused_moe_table: str | None = None  # routed experts: a tuned table file (None: the package's for the GPU)
    overlap_shared_experts: bool = False  # shared expert(s) on a second CUDA stream (ignored on the CPU)
    overlap_mla_absorb: bool = False  # MLA decode's absorb beside its rope on a second CUDA stream (ignored on the CPU)
    mla_absorbed_decode: bool = True  # MLA decode in the absorbed form (off: the expanded torch path, eager)
    merge_qkv: bool = True  # q/k/v (MLA: q and kv_a) as one GEMM and one LoRA pair (off: separate projections)
    merge_gate_up: bool = True  # a dense MLP's gate / up as one GEMM and one LoRA pair (off: two projections)
    dense_lora_policy: DenseLoRAPolicy = DENSE_LORA_POLICY  # which dense LoRA mode a call takes (Triton)
    # Triton kernels launched with programmatic dependent launch (`kernels/pdl.py`: compute capability >= 9.0;
    # elsewhere plain launches whatever this says)
    pdl: bool = False
    # the modules that keep LoRA slots (None: every site): the model's constructor drops the others' slots
    # (`models.lora_targets`) before anyone holds the model
    lora_target_modules: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.kernel_backend not in BACKENDS:
            raise ConfigError(f"kernel_backend must be one of {', '.join(BACKENDS)}, got {self.kernel_backend!r}")


DEFAULT_OPTIONS = LayerOptions()


def adopt_tensors(twin: nn.Module, source: nn.Module) -> nn.Module:
    """`twin`, built as `source` was but with other options, holding `source`'s parameters and buffers (the
    same tensors, no copy: a LoRA slot written in one is written in the other) and the LoRA sites both kept
    (`has_lora`: a site the twin's own targets dropped stays dropped, and one `source` dropped has no slots to
    share). Move `source` to its device first: `.to()` replaces buffers, and a twin made before would keep the
    old ones."""
    for mine, its in zip(source.modules(), twin.modules(), strict=True):
        if type(mine) is not type(its):
            raise ValueError(f"twin differs from its source: {type(its).__name__} where {type(mine).__name__} is")
        its._parameters.update(mine._parameters)
        its._buffers.update({k: v for k, v in mine._buffers.items() if its._buffers.get(k, v) is not None})
        if hasattr(mine, "has_lora"):
            its.has_lora = its.has_lora and mine.has_lora
        stale = [k for k, v in vars(its).items()
                 if isinstance(v, torch.Tensor) and v.is_meta and not getattr(mine, k).is_meta]
        if stale:  # a tensor outside the parameters and buffers would stay the twin's own (on the meta device)
            raise ValueError(f"{type(its).__name__} holds tensors outside its parameters and buffers: {stale}")
    return twin.train(source.training)
