"""Frozen model configs (contract 8), read from a Hugging Face `config.json`.

`ModelConfig.from_hf(path)` accepts both the old and the new spellings of the fields transformers
has renamed (`num_experts`/`num_local_experts`, `rope_theta`/`rope_parameters`,
`torch_dtype`/`dtype`, `rope_scaling`/`rope_parameters`) and raises `ConfigError` naming any
architecture or field value moelora does not implement. Every derived value is computed once, in
`resolve()`. DeepSeek-V2/V3 and GLM-4-MoE fields are parsed by `_parse_deepseek_glm`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelora.errors import ConfigError
from moelora.quant.config import FP8Config, parse_quantization_config

# HF architecture name -> family name used by moelora.models.registry.
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "Dots1ForCausalLM": "dots1",
}
# multi-head latent attention; GLM-4.7-Flash's `glm4_moe_lite` is DeepSeek-V3's attention with GLM-4-MoE's blocks
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
TOPK_METHODS = ("softmax", "greedy", "group_limited_greedy", "noaux_tc")

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "fp32": "float32",
           "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}


@dataclass(frozen=True)
class YarnRope:
    """YaRN rotary scaling (DeepSeek-V2/V3's config.json, and Qwen3's long-context one), as transformers'
    `_compute_yarn_parameters` reads it.

    `mscale` / `mscale_all_dim` of 0 mean absent; `attention_factor` None means derived.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs, in one family-neutral vocabulary.

    qk_norm: "none", "per_head" (RMSNorm over head_dim, Qwen3, GLM `use_qk_norm`) or "whole" (RMSNorm
    over the whole q / k projection, OLMoE). Sparse layers are listed in `sparse_layers` (computed in
    resolve(): not in `mlp_only_layers`, on the `decoder_sparse_step`, from `first_k_dense_replace` on).

    attention: "gqa" (q/k/v/o projections, paged K/V cache) or "mla" (DeepSeek multi-head latent
    attention: `q_proj` or `q_a_proj`/`q_b_proj` when `q_lora_rank` is set, `kv_a_proj_with_mqa`,
    `kv_b_proj`, `o_proj`; the cache holds the normalised latent [kv_lora_rank] and the rotary key
    [qk_rope_head_dim] per token). For MLA, head_dim = qk_nope_head_dim + qk_rope_head_dim and
    num_kv_heads = num_heads. `rotary_dim` (resolved): the rotated leading part of each head
    (head_dim * partial_rotary_factor; qk_rope_head_dim for MLA). `rope_interleave`: rotary pairs are
    (x0, x1), (x2, x3)... (DeepSeek) instead of the two halves. `rope_yarn`: YaRN scaling or None.

    topk_method: "softmax" (softmax over experts, top-k, optional renormalisation; Qwen/Mixtral/
    OLMoE), "greedy" / "group_limited_greedy" (DeepSeek-V2: softmax, top-k, optionally only from the
    `topk_group` groups of `n_group` with the highest max score, then * routed_scaling_factor), or
    "noaux_tc" (DeepSeek-V3 / GLM: sigmoid, top-k chosen on score + e_score_correction_bias from the
    `topk_group` groups with the highest sum of their top-2, weighted by the unbiased scores,
    optionally renormalised, then * routed_scaling_factor). `router_correction_bias`: the router has
    an `e_score_correction_bias` [E] (fp32, as the router weight of these three families).
    `n_shared_experts`: DeepSeek/GLM ungated `shared_experts` MLP of intermediate
    `shared_experts_intermediate_size` = moe_intermediate_size * n_shared_experts (resolved); Qwen2's
    gated `shared_expert` is `shared_expert_intermediate_size`.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP (non-sparse layers)
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    attention_bias: bool = False
    qk_norm: str = "none"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # rotary variants (GLM partial rotary, DeepSeek interleaved pairs and YaRN)
    partial_rotary_factor: float = 1.0
    rope_interleave: bool = False
    rope_yarn: YarnRope | None = None
    # multi-head latent attention (DeepSeek-V2/V3)
    attention: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # routing and shared experts (DeepSeek-V2/V3, GLM-4-MoE)
    topk_method: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_correction_bias: bool = False
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    # resolved
    sparse_layers: tuple[int, ...] = field(default=())
    rotary_dim: int = 0
    shared_experts_intermediate_size: int = 0
    # FP8 checkpoint (config.json's quantization_config; `moelora.quant.config`), None: high precision
    quantization: FP8Config | None = None

    @property
    def max_context_len(self) -> int:
        """The longest sequence the positions cover: max_position_embeddings, or under YaRN the original positions
        times its factor where that is longer (vLLM's derived max_model_len: Qwen3-30B-A3B's 32768 x 4 = 131072 with
        its long-context rope_scaling, past its 40960 max_position_embeddings)."""
        if self.rope_yarn is None:
            return self.max_position_embeddings
        return max(self.max_position_embeddings,
                   int(self.rope_yarn.original_max_position_embeddings * self.rope_yarn.factor))

    def resolve(self) -> ModelConfig:
        """Validate and fill derived fields; returns a new config."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "num_experts", "top_k", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_kv_heads}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.top_k} exceeds num_experts={self.num_experts}")
        if self.qk_norm not in ("none", "per_head", "whole"):
            raise ConfigError(f"unsupported qk_norm {self.qk_norm!r}")
        sparse = tuple(i for i in range(self.num_layers) if i not in self.mlp_only_layers
                       and (i + 1) % self.decoder_sparse_step == 0 and i >= self.first_k_dense_replace)
        if any(i not in sparse for i in range(self.num_layers)) and self.intermediate_size <= 0:
            raise ConfigError("dense layers present but intermediate_size is not positive")
        self._check_routing()
        if self.attention == "mla":
            self._check_mla()
        elif self.attention != "gqa":
            raise ConfigError(f"unsupported attention {self.attention!r}")
        rotary_dim = (self.qk_rope_head_dim if self.attention == "mla"
                      else int(self.head_dim * self.partial_rotary_factor))
        if not 0 < rotary_dim <= self.head_dim or rotary_dim % 2:
            raise ConfigError(f"rotary dimension {rotary_dim} (head_dim={self.head_dim} * partial_rotary_factor="
                              f"{self.partial_rotary_factor}) must be even and in (0, head_dim]")
        return dataclasses.replace(self, sparse_layers=sparse, rotary_dim=rotary_dim,
                                   shared_experts_intermediate_size=self.moe_intermediate_size * self.n_shared_experts)

    def _check_routing(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ConfigError(f"unsupported topk_method {self.topk_method!r} (supported: {', '.join(TOPK_METHODS)})")
        if self.n_shared_experts < 0:
            raise ConfigError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.topk_method not in ("group_limited_greedy", "noaux_tc"):
            return
        e, g, tg = self.num_experts, self.n_group, self.topk_group
        if g <= 0 or e % g or not 0 < tg <= g:
            raise ConfigError(f"grouped routing needs n_group dividing n_routed_experts={e} and 0 < topk_group <= "
                              f"n_group; got n_group={g}, topk_group={tg}")
        if self.topk_method == "noaux_tc" and e // g < 2:
            raise ConfigError(f"noaux_tc routing scores a group by its top-2 experts; n_group={g} leaves "
                              f"{e // g} expert(s) per group")
        if tg * (e // g) < self.top_k:
            raise ConfigError(f"num_experts_per_tok={self.top_k} exceeds the {tg * (e // g)} experts of the "
                              f"topk_group={tg} selected groups")

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.qk_nope_head_dim < 0 or (self.q_lora_rank is not None and self.q_lora_rank <= 0):
            raise ConfigError(f"invalid MLA sizes qk_nope_head_dim={self.qk_nope_head_dim}, "
                              f"q_lora_rank={self.q_lora_rank}")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim or self.num_kv_heads != self.num_heads:
            raise ConfigError("MLA needs head_dim = qk_nope_head_dim + qk_rope_head_dim and num_kv_heads = num_heads")

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @property
    def latent_cache_dim(self) -> int:
        """MLA: what one token stores per layer (normalised latent + rotary key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """Read `config.json` from a model directory (or the file itself); `overrides`: vLLM's --hf-overrides
        (`apply_hf_overrides`)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from None
        return cls.from_dict(apply_hf_overrides(raw, overrides))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None and not archs and raw.get("model_type") in ARCHITECTURES.values():
            family = raw["model_type"]  # configs built in memory carry no `architectures`
        if family is None:
            known = ", ".join(sorted(ARCHITECTURES))
            raise ConfigError(f"unsupported architecture {archs or raw.get('model_type')!r}; "
                              f"moelora supports {known}")
        return _parse(family, raw).resolve()


def _get(raw: dict[str, Any], *names: str, default: Any = ConfigError) -> Any:
    for n in names:
        if n in raw and raw[n] is not None:
            return raw[n]
    if default is ConfigError:
        raise ConfigError(f"config.json lacks required field {names[0]!r}")
    return default


def apply_hf_overrides(raw: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """config.json's fields with vLLM's --hf-overrides over them (top-level keys replaced). A `rope_scaling` or
    `rope_theta` given also lands in `rope_parameters` where the file keeps its rotary there (transformers 5 writes
    both spellings' fields into it), over its fields, so the override wins and the file's other fields stay."""
    if not overrides:
        return raw
    if not isinstance(overrides, dict):
        raise ConfigError(f"hf_overrides must be a JSON object of config.json fields, got {overrides!r}")
    out = {**raw, **overrides}
    if "rope_parameters" in overrides or not isinstance(raw.get("rope_parameters"), dict):
        return out
    rotary = dict(overrides["rope_scaling"]) if isinstance(overrides.get("rope_scaling"), dict) else {}
    if "type" in rotary:  # the old spelling of rope_type
        rotary.setdefault("rope_type", rotary.pop("type"))
    if "rope_theta" in overrides:
        rotary["rope_theta"] = overrides["rope_theta"]
    if rotary:
        out["rope_parameters"] = {**raw["rope_parameters"], **rotary}
    return out


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _rope_theta(raw: dict[str, Any], family: str = "") -> float:
    params = _rope_params(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None, "yarn"):
        raise ConfigError(f"unsupported rope_type {rope_type!r} for {family or 'this model'} ('default' and 'yarn' "
                          f"rotary are implemented)")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    return float(theta if theta is not None else 10000.0)


def _check_unsupported(family: str, raw: dict[str, Any]) -> None:
    if raw.get("use_sliding_window") or (family == "mixtral" and raw.get("sliding_window")):
        raise ConfigError(f"sliding_window={raw.get('sliding_window')} is not supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r} (only 'silu')")
    if family == "olmoe" and raw.get("clip_qkv") is not None:
        raise ConfigError(f"unsupported clip_qkv={raw['clip_qkv']}")


def _common(family: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The fields every family spells the same way."""
    dtype_name = str(_get(raw, "dtype", "torch_dtype", default="bfloat16"))
    if dtype_name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype_name!r}")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return dict(
        family=family,
        vocab_size=int(_get(raw, "vocab_size")),
        hidden_size=int(_get(raw, "hidden_size")),
        num_layers=int(_get(raw, "num_hidden_layers")),
        num_heads=int(_get(raw, "num_attention_heads")),
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        max_position_embeddings=int(_get(raw, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=_DTYPES[dtype_name],
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        quantization=parse_quantization_config(raw.get("quantization_config")),
    )


def _yarn(raw: dict[str, Any]) -> YarnRope | None:
    params = _rope_params(raw)
    if params.get("rope_type", params.get("type", "default")) != "yarn":
        return None
    known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate", "partial_rotary_factor"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(f"unsupported yarn rope parameter(s) {unknown}")
    orig = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    orig = int(orig if orig is not None else _get(raw, "max_position_embeddings"))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(_get(raw, "max_position_embeddings")) / orig
    att = params.get("attention_factor")
    return YarnRope(factor=factor, original_max_position_embeddings=orig,
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
                    attention_factor=None if att is None else float(att), truncate=bool(params.get("truncate", True)))


def _check_deepseek_glm(family: str, raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r} (only 'silu')")
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias=True is not supported")
    if int(raw.get("moe_layer_freq") or 1) != 1:
        raise ConfigError(f"moe_layer_freq={raw['moe_layer_freq']} is not supported (only 1)")
    scoring = raw.get("scoring_func")
    want_scoring = "softmax" if family == "deepseek_v2" else "sigmoid"
    if scoring is not None and scoring != want_scoring:
        raise ConfigError(f"scoring_func={scoring!r} is not supported for {family} (only {want_scoring!r})")
    if family == "deepseek_v2" and raw.get("norm_topk_prob"):
        raise ConfigError("norm_topk_prob=True is not supported for deepseek_v2: DeepSeek's reference code "
                          "renormalises instead of scaling, transformers scales and ignores it")


def _topk_method(family: str, raw: dict[str, Any]) -> str:
    method = raw.get("topk_method")
    if family == "deepseek_v2":
        method = method or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"unsupported topk_method {method!r} for deepseek_v2 "
                              f"(supported: 'greedy', 'group_limited_greedy')")
        return method
    if method not in (None, "noaux_tc"):
        raise ConfigError(f"unsupported topk_method {method!r} for {family} (only 'noaux_tc')")
    return "noaux_tc"


def _first_dense(family: str, raw: dict[str, Any]) -> int:
    """The leading dense layers: `first_k_dense_replace`, or GLM-4.7-Flash's `mlp_layer_types` ("dense" layers, then
    "sparse" ones; transformers' default: one dense layer)."""
    if family != "glm4_moe_lite":
        return int(raw.get("first_k_dense_replace") or 0)
    kinds = list(raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (int(_get(raw, "num_hidden_layers")) - 1))
    dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
    if len(kinds) != int(_get(raw, "num_hidden_layers")) or any(kind != "sparse" for kind in kinds[dense:]):
        raise ConfigError(f"mlp_layer_types={kinds} is not supported: one per layer, dense layers first and sparse "
                          "ones after")
    return dense


def _parse_deepseek_glm(family: str, raw: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V2/V3 (MLA), GLM-4-MoE (GQA, partial rotary), dots.llm1 (`dots1`: GQA with per-head q / k norms)
    and GLM-4.7-Flash (`glm4_moe_lite`: V3's MLA, dense layers listed in `mlp_layer_types`): grouped routing,
    shared experts."""
    _check_deepseek_glm(family, raw)
    common = _common(family, raw)
    heads, hidden = common["num_heads"], common["hidden_size"]
    method = _topk_method(family, raw)
    n_group = int(raw.get("n_group") or 1)
    topk_group = int(raw.get("topk_group") or 1)
    if method == "greedy":
        n_group = topk_group = 1
    routing = dict(
        intermediate_size=int(_get(raw, "intermediate_size", default=0)),
        moe_intermediate_size=int(_get(raw, "moe_intermediate_size")),
        num_experts=int(_get(raw, "n_routed_experts", "num_experts", "num_local_experts")),
        top_k=int(_get(raw, "num_experts_per_tok")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", family != "deepseek_v2")),
        topk_method=method, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=1.0)),
        router_correction_bias=method == "noaux_tc",
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        first_k_dense_replace=_first_dense(family, raw),
        rope_theta=_rope_theta(raw, family),
    )
    if family in ("glm4_moe", "dots1"):  # dots.llm1: Qwen3's attention (per-head q / k norms, whole rotary)
        params = _rope_params(raw)
        factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        head_dim = int(_get(raw, "head_dim", default=hidden // heads))
        if family == "dots1":
            sliding = [i for i, kind in enumerate(raw.get("layer_types") or ()) if kind != "full_attention"]
            if sliding:
                raise ConfigError(f"layer_types marks layers {sliding[:8]} as sliding-window attention: not supported")
        return ModelConfig(
            **common, **routing, num_kv_heads=int(_get(raw, "num_key_value_heads", default=heads)), head_dim=head_dim,
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm="per_head" if raw.get("use_qk_norm") or family == "dots1" else "none",
            partial_rotary_factor=float(factor if factor is not None else 0.5 if family == "glm4_moe" else 1.0),
            rope_yarn=_yarn(raw))
    nope, rope = int(_get(raw, "qk_nope_head_dim")), int(_get(raw, "qk_rope_head_dim"))
    factor = _rope_params(raw).get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if family == "glm4_moe_lite" and factor not in (None, 1, 1.0):  # transformers would rotate part of the rope dims
        raise ConfigError(f"partial_rotary_factor={factor} is not supported for glm4_moe_lite (only 1.0: the rotary "
                          "covers qk_rope_head_dim)")
    q_rank = raw.get("q_lora_rank")
    return ModelConfig(
        **common, **routing, num_kv_heads=heads, head_dim=nope + rope, attention="mla",
        attention_bias=bool(raw.get("attention_bias", False)),
        q_lora_rank=None if q_rank is None else int(q_rank), kv_lora_rank=int(_get(raw, "kv_lora_rank")),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(_get(raw, "v_head_dim")),
        rope_interleave=True if family == "deepseek_v2" else bool(raw.get("rope_interleave", True)),
        rope_yarn=_yarn(raw))


def _parse_minimax_m2(raw: dict[str, Any]) -> ModelConfig:
    """MiniMax-M2 (M2 / M2.1 / M2.5), as transformers' `MiniMaxM2ForCausalLM` runs it: GQA with q / k RMSNorm over
    the whole projection and a partial rotary (`rotary_dim` of each head); every layer sparse, Mixtral-style experts
    of `intermediate_size`; a sigmoid router choosing on score + `e_score_correction_bias`, weights renormalised: the
    "noaux_tc" router with one group and no scaling. Its multi-token-prediction modules are not run."""
    _check_unsupported("minimax_m2", raw)
    common = _common("minimax_m2", raw)
    hidden, heads = common["hidden_size"], common["num_heads"]
    head_dim = int(_get(raw, "head_dim", default=hidden // heads))
    checks = (("use_qk_norm", True), ("qk_norm_type", "per_layer"), ("scoring_func", "sigmoid"),
              ("use_routing_bias", True))
    for key, want in checks:
        if raw.get(key) is not None and raw[key] != want:
            raise ConfigError(f"{key}={raw[key]!r} is not supported for minimax_m2 (only {want!r}, as transformers "
                              "runs the model)")
    linear = [i for i, kind in enumerate(raw.get("attn_type_list") or ()) if int(kind) != 1]
    if linear:
        raise ConfigError(f"attn_type_list marks layers {linear[:8]} as linear (lightning) attention: only full "
                          "attention (MiniMax-M2) is supported")
    if int(raw.get("shared_intermediate_size") or 0):
        raise ConfigError(f"shared_intermediate_size={raw['shared_intermediate_size']} is not supported for "
                          "minimax_m2 (transformers' MiniMax-M2 has no shared expert)")
    scaling = float(raw.get("routed_scaling_factor") or 1.0)
    if scaling != 1.0:
        raise ConfigError(f"routed_scaling_factor={scaling} is not supported for minimax_m2 (transformers' router "
                          "does not scale)")
    params = _rope_params(raw)
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor is None and raw.get("rotary_dim") is not None:  # the released checkpoints' spelling
        factor = int(raw["rotary_dim"]) / head_dim
    inter = int(_get(raw, "intermediate_size"))
    return ModelConfig(
        **common, num_kv_heads=int(_get(raw, "num_key_value_heads", default=heads)), head_dim=head_dim,
        intermediate_size=inter, moe_intermediate_size=inter,
        num_experts=int(_get(raw, "num_local_experts", "num_experts")), top_k=int(_get(raw, "num_experts_per_tok")),
        norm_topk_prob=True, qk_norm="whole", rope_theta=_rope_theta(raw),
        partial_rotary_factor=float(1.0 if factor is None else factor), rope_yarn=_yarn(raw),
        topk_method="noaux_tc", router_correction_bias=True)


def _parse(family: str, raw: dict[str, Any]) -> ModelConfig:
    if family in (*MLA_FAMILIES, "glm4_moe", "dots1"):
        return _parse_deepseek_glm(family, raw)
    if family == "minimax_m2":
        return _parse_minimax_m2(raw)
    _check_unsupported(family, raw)
    common = _common(family, raw)
    hidden, heads = common["hidden_size"], common["num_heads"]
    moe_inter = _get(raw, "moe_intermediate_size", "intermediate_size")
    qk_norm = {"qwen3_moe": "per_head", "olmoe": "whole"}.get(family, "none")
    return ModelConfig(
        **common,
        num_kv_heads=int(_get(raw, "num_key_value_heads", default=heads)),
        head_dim=int(_get(raw, "head_dim", default=hidden // heads)),
        intermediate_size=int(_get(raw, "intermediate_size", default=0)),
        moe_intermediate_size=int(moe_inter),
        num_experts=int(_get(raw, "num_experts", "num_local_experts")),
        top_k=int(_get(raw, "num_experts_per_tok")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", family == "mixtral")) or family == "mixtral",
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
        if family == "qwen2_moe" else 0,
        attention_bias=bool(raw.get("qkv_bias", raw.get("attention_bias", family == "qwen2_moe"))),
        qk_norm=qk_norm,
        rope_theta=_rope_theta(raw),
        rope_yarn=_yarn(raw),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
    )
