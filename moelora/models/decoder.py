"""The MoE decoder shared by Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and GLM-4-MoE (GQA attention),
and, with its attention swapped for MLA, DeepSeek-V2/V3 (`moelora.models.deepseek`).

Shape legend: T tokens in the step, H hidden, V vocab. The families differ only in what
`ModelConfig` records (q/k norm kind, q/k/v bias, partial rotary, shared expert(s), sparse and
dense layers, router method), so they share this module tree; its parameter names are
transformers 5's.
`forward(input_ids [T], positions [T], meta, kv_caches, lora) -> hidden [T, H]`;
`logits(hidden) -> [T, V]`.

Under tensor / expert parallelism (`shard`, `moelora.parallel`) the same tree is built from the rank's
local config (`ShardPlan.local_config`: its heads and intermediate sizes), so every projection holds its
shard; attention and the MLP / MoE block return partial sums that one all-reduce each completes (row-
parallel o_proj and down projections carry no bias), the embedding and LM head are vocab-parallel, and
EP layers hold their experts (`layers.parallel_experts`). `shard` None: one device, nothing changes.
"""

from __future__ import annotations

import torch
from torch import nn

from moelora.config import ModelConfig
from moelora.errors import AdapterError
from moelora.layers.attention import Attention, AttnMetadata
from moelora.layers.linear import LinearSite
from moelora.layers.mlp import DenseMLP
from moelora.layers.moe import Experts, SparseMoE
from moelora.layers.norm import Delta, RMSNorm
from moelora.layers.options import DEFAULT_OPTIONS, LayerOptions, adopt_tensors
from moelora.layers.rotary import RotaryEmbedding
from moelora.layers.router import RoutingSpec
from moelora.lora.adapter import LoRAAdapter
from moelora.lora.batch import LoRABatch
from moelora.models.lora_targets import restrict_lora_sites
from moelora.quant.config import FP8Config
from moelora.quant.storage import activation_quantizer


def gqa_attention(cfg: ModelConfig, shard=None, **kw) -> nn.Module:
    make_norm = None
    if shard is not None and cfg.qk_norm == "whole":  # OLMoE: the q/k norm spans every rank's heads
        from moelora.layers.parallel_norm import ShardedRMSNorm

        def make_norm(width: int) -> nn.Module:
            return ShardedRMSNorm(width, cfg.rms_norm_eps, shard)
    return Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     bias=cfg.attention_bias, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps, make_norm=make_norm, **kw)


def sparse_moe(cfg: ModelConfig, shard=None, **kw) -> SparseMoE:
    experts = None
    if shard is not None and shard.plan.expert_parallel:
        from moelora.layers.parallel_experts import ExpertParallelExperts

        first, count = shard.plan.experts(cfg)
        experts = ExpertParallelExperts(first, count, cfg.hidden_size, cfg.moe_intermediate_size,
                                        num_experts=cfg.num_experts, **kw)
    routing = RoutingSpec(cfg.topk_method, cfg.top_k, cfg.norm_topk_prob, cfg.n_group, cfg.topk_group,
                          cfg.routed_scaling_factor)
    return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob,
                     cfg.shared_expert_intermediate_size, routing=routing,
                     shared_experts_inter=cfg.shared_experts_intermediate_size,
                     correction_bias=cfg.router_correction_bias, experts=experts, **kw)


class DecoderLayer(nn.Module):
    """One pre-norm block. The residual stream enters as (residual, delta) -- the layer input is
    residual + delta, delta None for the first layer -- and leaves as (h, mlp_out), the next layer's
    pair: the add before each norm is fused into that norm (`RMSNorm.add_forward`), two launches a
    layer under the Triton backend, with the torch backend's sums and roundings unchanged. An MoE block
    with shared experts hands on (routed, shared) unsummed (`SparseMoE.forward_parts`): the next norm
    adds both, rounding their sum first as `routed + shared` did, one launch a layer fewer."""

    def __init__(self, cfg: ModelConfig, idx: int, make_attention=gqa_attention, shard=None, **kw):
        super().__init__()
        backend, pdl = kw["options"].kernel_backend, kw["options"].pdl
        self.shard = shard  # tensor parallelism: attention and MLP outputs are partial sums
        # W8A8 on the Triton kernels: each norm also writes its rows quantized, for every FP8 GEMM reading them
        self.fp8_inputs = backend == "triton" and activation_quantizer(kw.get("quant")) is not None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, pdl)
        self.self_attn = make_attention(cfg, shard=shard, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, pdl)
        if cfg.is_sparse(idx):
            self.mlp = sparse_moe(cfg, shard, **kw)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, **kw)

    def _norm(self, norm: RMSNorm, x: torch.Tensor, delta: Delta):
        """(h, normed, its FP8Rows for the W8A8 GEMMs reading it, or None)."""
        return norm.add_forward_fp8(x, delta) if self.fp8_inputs else (*norm.add_forward(x, delta), None)

    def forward(self, residual: torch.Tensor, delta: Delta, cos, sin, meta, kv, lora) -> tuple[torch.Tensor, Delta]:
        x, normed, rows = self.attention_input(residual, delta)
        return self.after_attention(x, self.self_attn(normed, cos, sin, meta, kv, lora, x_fp8=rows), lora)

    def attention_input(self, residual: torch.Tensor, delta: Delta):
        """The layer input residual + delta and the attention's input: (x, normed, its FP8Rows or None)."""
        return self._norm(self.input_layernorm, residual, delta)

    def after_attention(self, x: torch.Tensor, attn: torch.Tensor, lora) -> tuple[torch.Tensor, Delta]:
        """From the attention's output [T, H] (o_proj's; a partial sum under tensor parallelism) to the next
        layer's pair (h, mlp_out)."""
        if self.shard is not None:
            attn = self.shard.all_reduce(attn)
        h, normed, rows = self._norm(self.post_attention_layernorm, x, attn)
        if self.shard is not None:
            return h, self.shard.all_reduce(self.mlp(normed, lora, x_fp8=rows))
        if isinstance(self.mlp, SparseMoE):  # (routed, shared) unsummed: the next norm adds them
            return h, self.mlp.forward_parts(normed, lora, x_fp8=rows)
        return h, self.mlp(normed, lora, x_fp8=rows)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, make_attention=gqa_attention, shard=None, **kw):
        super().__init__()
        dtype = kw.get("dtype")
        if shard is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        else:
            from moelora.layers.vocab_parallel import VocabParallelEmbedding

            start, _, rows = shard.plan.vocab(cfg)
            self.embed_tokens = VocabParallelEmbedding(start, rows, cfg.hidden_size, shard, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, make_attention, shard, **kw) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kw["options"].kernel_backend, kw["options"].pdl)


class MoECausalLM(nn.Module):
    # Whether decode may be captured in CUDA graphs (every layer has a graph-safe path).
    supports_cuda_graphs = True

    def __init__(self, cfg: ModelConfig, *, max_loras: int = 0, max_rank: int = 0,
                 options: LayerOptions = DEFAULT_OPTIONS, dtype: torch.dtype | None = None,
                 quant: FP8Config | None = None, shard=None):
        super().__init__()
        self.config, self.shard = cfg, shard  # `shard`: this rank's `moelora.parallel.shard.Shard`, or None
        self.layer_config = cfg if shard is None else shard.plan.local_config(cfg)
        self.options = options  # every layer's, given to its constructor (`layers.options`)
        # quant: FP8 storage of every projection (attention, MLPs, experts; `moelora.quant`), None: dtype
        kw = dict(max_loras=max_loras, max_rank=max_rank, options=options, dtype=dtype, quant=quant)
        self.build_args = dict(kw, shard=shard)  # the constructor's arguments (`with_options` rebuilds with them)
        self.max_loras = max_loras  # adapter slots of every LoRA site (a row plan groups rows over them)
        self.model = Backbone(self.layer_config, self.make_attention, shard, **kw)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_yarn)
        head_rows = cfg.vocab_size if shard is None else shard.plan.vocab(cfg)[2]
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, head_rows, bias=False, dtype=dtype)
        restrict_lora_sites(self, options.lora_target_modules)  # the sites this model serves LoRA at

    @staticmethod
    def make_attention(cfg: ModelConfig, shard=None, **kw) -> nn.Module:
        """The attention module of one layer (a family with another attention overrides this)."""
        return gqa_attention(cfg, shard, **kw)

    def with_options(self, options: LayerOptions) -> MoECausalLM:
        """This model under other layer options: itself when they are its own, else a twin built through the
        constructors with `options` (on the meta device) holding this model's tensors (`adopt_tensors`:
        weights and LoRA slots, no copy) and LoRA sites. One model, several engine configs (tests, benchmarks)."""
        if options == self.options:
            return self
        with torch.device("meta"):
            twin = type(self)(self.config, **dict(self.build_args, options=options))
        return adopt_tensors(twin, self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                kv_caches: list[tuple[torch.Tensor, ...]], lora: LoRABatch | None = None
                ) -> torch.Tensor:
        residual, delta = self.model.embed_tokens(input_ids), None
        cos, sin = self.rotary(positions)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            residual, delta = layer(residual, delta, cos, sin, meta, kv, lora)
        return self.model.norm.add_forward(residual, delta)[1]

    def kv_cache_shapes(self) -> list[tuple[tuple[int, ...], ...]]:
        """What one token stores in the paged cache, per layer: keys and values [N_kv, D]."""
        kv = (self.layer_config.num_kv_heads, self.config.head_dim)
        return [(kv, kv) for _ in range(self.config.num_layers)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.shard is not None:
            from moelora.layers.vocab_parallel import vocab_parallel_logits

            return vocab_parallel_logits(hidden, weight, self.shard, self.config.vocab_size)
        return torch.nn.functional.linear(hidden, weight)

    def weight_params(self) -> dict[str, torch.Tensor]:
        """Checkpoint destinations, by transformers-5 name (what `load_checkpoint` fills): the
        parameters, with a merged projection's as its segments' views (`self_attn.q_proj.weight`)."""
        return {n: p for n, p in self.state_dict(keep_vars=True).items() if not n.startswith("rotary")}

    def lora_sites(self) -> dict[str, tuple[nn.Module, str | None]]:
        """Adapter site key -> (module, expert projection or None), for every LoRA-capable site."""
        sites: dict[str, tuple[nn.Module, str | None]] = {}
        for name, mod in self.named_modules():
            if isinstance(mod, LinearSite) and mod.has_lora:
                sites[name] = (mod, None)
            elif isinstance(mod, Experts) and mod.has_lora:
                sites[f"{name}.gate_up"] = (mod, "gate_up")
                sites[f"{name}.down"] = (mod, "down")
        return sites

    def lora_site_dtypes(self) -> dict[str, torch.dtype]:
        """Adapter site key -> the dtype of its slot buffers (an adapter is staged in these)."""
        return {key: (mod.lora_a if proj is None else getattr(mod, f"lora_{proj}_a")).dtype
                for key, (mod, proj) in self.lora_sites().items()}

    @torch.no_grad()
    def set_lora_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Write `adapter` into `slot` at every site (sites it lacks are zeroed); None empties it."""
        sites = self.lora_sites()
        unknown = sorted(set(adapter.sites) - set(sites)) if adapter is not None else []
        if unknown:
            raise AdapterError(f"adapter {adapter.name!r} targets modules this model has no LoRA site for: "
                               f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for key, (mod, proj) in sites.items():
            weights = adapter.sites.get(key) if adapter is not None else None
            if proj is None:
                mod.set_lora_slot(slot, weights)
            else:
                mod.set_lora_slot(slot, proj, weights)
