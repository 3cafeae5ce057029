"""DeepSeek-V2/V3: the shared MoE decoder with multi-head latent attention and a latent KV cache.

What differs from `moelora.models.decoder` (everything else -- grouped routers, fp32 router and
correction bias, ungated shared experts, dense first layers -- is configuration of shared blocks):
- attention is `MLAttention` (q_proj or q_a_proj/q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj);
  softmax scale (qk_nope + qk_rope)^-0.5, times YaRN's mscale_all_dim factor squared under YaRN;
- rotary covers qk_rope_head_dim, in interleaved pairs (V2 always, V3 per `rope_interleave`);
- each layer caches one vector per token: kv_lora_rank + qk_rope_head_dim; decode steps attend on it
  directly (weights absorbed, `moelora.layers.mla`), so decode is captured in CUDA graphs as for GQA.
"""

from __future__ import annotations

from torch import nn

from moelora.config import ModelConfig
from moelora.layers.mla import MLAttention
from moelora.layers.rotary import yarn_softmax_scale
from moelora.models.decoder import MoECausalLM


class DeepseekCausalLM(MoECausalLM):
    supports_cuda_graphs = True  # decode steps run MLA in the absorbed form (no host loop or sync)

    @staticmethod
    def make_attention(cfg: ModelConfig, shard=None, **kw) -> nn.Module:
        """`cfg` holds this rank's heads under tensor parallelism (`shard`): MLA needs nothing else."""
        scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * yarn_softmax_scale(cfg.rope_yarn)
        return MLAttention(cfg.hidden_size, cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
                           kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                           qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                           bias=cfg.attention_bias, interleave=cfg.rope_interleave, softmax_scale=scale, **kw)

    def kv_cache_shapes(self) -> list[tuple[tuple[int, ...], ...]]:
        """One latent vector per token and layer: the normalised kv latent and the rotary key."""
        return [((self.config.latent_cache_dim,),) for _ in range(self.config.num_layers)]
