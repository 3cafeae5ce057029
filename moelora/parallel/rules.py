"""Sharding rules: which dim of which tensor splits on which rank (one place for weights and adapters).

Shape legend: N ranks, r this rank, H hidden, V vocab, Nh heads, Nkv KV heads, D head dim, I an
intermediate size, E routed experts.

A `Cut` names, per dim of the FULL tensor, the index ranges this rank keeps, concatenated in order (a
fused expert gate_up [E, 2I, H] keeps two row ranges, its gate and its up part); a tensor with no cut is
replicated. The rules (parameter names are transformers 5's):
- column-parallel (split by output rows): q/k/v (GQA, by heads; KV heads replicated when Nkv < N, rank r
  holding KV head r // (N / Nkv)), MLA q_proj / q_b_proj / kv_b_proj (by heads), dense MLP and shared
  experts gate/up (by intermediate rows), OLMoE's whole-width q/k norm weights (as q / k);
- row-parallel (split by input columns): o_proj (by heads), down_proj of the dense MLP and shared experts;
- routed experts: TP splits each expert's intermediate (gate_up rows, down columns); EP keeps experts
  [r E/N, (r+1) E/N) whole;
- vocab-parallel: embed_tokens / lm_head rows [r ceil(V/N), ...), the last rank padded with zero rows;
- row-parallel biases (MLA o_proj with attention_bias): rank 0 holds them, the others zeros;
- replicated: norms, routers (and their correction bias), Qwen2's shared_expert_gate, MLA's q_a_proj and
  kv_a_proj_with_mqa (the latent is computed whole on every rank and cached per rank).
LoRA follows its weight (contract 9): an output-row cut applies to B's rows, an input-column cut to A's
columns, an expert cut to both (`adapters.py`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from moelora.config import ModelConfig
from moelora.errors import ConfigError

Cut = tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # ((dim, ((start, stop), ...)), ...)

_SHARED = re.compile(r"\.mlp\.(shared_experts?)\.(gate_proj|up_proj|down_proj)\.weight$")
_DENSE = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`; `expert_parallel`: routed experts partitioned (else split inside)."""

    rank: int
    size: int
    expert_parallel: bool = False

    # checks ------------------------------------------------------------------------------------
    def check(self, cfg: ModelConfig) -> None:
        """ConfigError naming the first shape that cannot be split `size` ways."""
        n = self.size

        def need(value: int, what: str, hint: str = "") -> None:
            if value % n:
                raise ConfigError(f"tensor_parallel_size={n} does not divide {what}={value}{hint}")
        need(cfg.num_heads, "num_attention_heads")
        if cfg.attention == "gqa" and cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            raise ConfigError(f"tensor_parallel_size={n} and num_key_value_heads={cfg.num_kv_heads}: KV heads "
                              "split when the size divides them and are replicated when they divide the size; "
                              "neither holds")
        if any(not cfg.is_sparse(i) for i in range(cfg.num_layers)):
            need(cfg.intermediate_size, "intermediate_size (dense MLP)")
        if self.expert_parallel:
            need(cfg.num_experts, "num_experts", " (expert parallelism partitions the routed experts)")
        else:
            need(cfg.moe_intermediate_size, "moe_intermediate_size",
                 " (or partition the experts instead: --enable-expert-parallel)")
        if cfg.shared_expert_intermediate_size:
            need(cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        if cfg.shared_experts_intermediate_size:
            need(cfg.shared_experts_intermediate_size, "moe_intermediate_size * n_shared_experts (shared experts)")

    # local sizes --------------------------------------------------------------------------------
    def heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first head, local head count)."""
        per = cfg.num_heads // self.size
        return self.rank * per, per

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first KV head, local KV head count); one replicated KV head when Nkv < N."""
        if cfg.num_kv_heads >= self.size:
            per = cfg.num_kv_heads // self.size
            return self.rank * per, per
        return self.rank // (self.size // cfg.num_kv_heads), 1

    def experts(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first expert, local expert count)."""
        if not self.expert_parallel:
            return 0, cfg.num_experts
        per = cfg.num_experts // self.size
        return self.rank * per, per

    def vocab(self, cfg: ModelConfig) -> tuple[int, int, int]:
        """(first row, rows read from the checkpoint, local rows incl. padding)."""
        per = -(-cfg.vocab_size // self.size)
        start = min(self.rank * per, cfg.vocab_size)
        return start, min(per, cfg.vocab_size - start), per

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with this rank's head counts and intermediate sizes: the module tree built from it has
        exactly the shard shapes (routed experts keep `num_experts`: the router scores all of them)."""
        n = self.size
        split_moe = 1 if self.expert_parallel else n
        return dataclasses.replace(
            cfg, num_heads=cfg.num_heads // n, num_kv_heads=self.kv_heads(cfg)[1],
            intermediate_size=cfg.intermediate_size // n if cfg.intermediate_size % n == 0 else 0,
            moe_intermediate_size=cfg.moe_intermediate_size // split_moe,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // n,
            shared_experts_intermediate_size=cfg.shared_experts_intermediate_size // n)

    def drops(self, name: str) -> bool:
        """Whether this rank holds zeros for replicated tensor `name`: a row-parallel projection's bias
        (MLA's o_proj with attention_bias), added by rank 0 alone so the all-reduce adds it once."""
        return self.rank > 0 and name.endswith(".self_attn.o_proj.bias")

    # cuts ---------------------------------------------------------------------------------------
    def _rows(self, first: int, count: int, width: int) -> tuple[tuple[int, int], ...]:
        return ((first * width, (first + count) * width),)

    def _part(self, full: int) -> tuple[tuple[int, int], ...]:
        per = full // self.size
        return ((self.rank * per, (self.rank + 1) * per),)

    def cut(self, name: str, cfg: ModelConfig) -> Cut | None:
        """This rank's cut of full tensor `name` (None: replicated)."""
        if self.size == 1:
            return None
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            start, rows, _ = self.vocab(cfg)
            return ((0, ((start, start + rows),)),)
        if ".self_attn." in name:
            return self._attention_cut(name, cfg)
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            return self._expert_cut(name, cfg)
        m = _SHARED.search(name)
        if m:
            inter = (cfg.shared_expert_intermediate_size if m[1] == "shared_expert"
                     else cfg.shared_experts_intermediate_size)
            return ((1 if m[2] == "down_proj" else 0, self._part(inter)),)
        m = _DENSE.search(name)
        if m:
            return ((1 if m[1] == "down_proj" else 0, self._part(cfg.intermediate_size)),)
        return None

    def _attention_cut(self, name: str, cfg: ModelConfig) -> Cut | None:
        leaf = name.split(".self_attn.", 1)[1]
        h0, nh = self.heads(cfg)
        if cfg.attention == "mla":
            q_width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            widths = {"q_proj.weight": (0, q_width), "q_b_proj.weight": (0, q_width),
                      "kv_b_proj.weight": (0, cfg.qk_nope_head_dim + cfg.v_head_dim),
                      "o_proj.weight": (1, cfg.v_head_dim)}
            if leaf not in widths:
                return None  # q_a_proj, kv_a_proj_with_mqa, their norms (and o_proj's bias) are replicated
            dim, width = widths[leaf]
            return ((dim, self._rows(h0, nh, width)),)
        D = cfg.head_dim
        kv0, nkv = self.kv_heads(cfg)
        proj, _, kind = leaf.partition(".")
        if proj == "o_proj":
            return ((1, self._rows(h0, nh, D)),) if kind == "weight" else None
        if proj == "q_proj" or (proj == "q_norm" and cfg.qk_norm == "whole"):
            return ((0, self._rows(h0, nh, D)),)
        if proj in ("k_proj", "v_proj") or (proj == "k_norm" and cfg.qk_norm == "whole"):
            return ((0, self._rows(kv0, nkv, D)),)
        return None  # per-head q/k norms

    def _expert_cut(self, name: str, cfg: ModelConfig) -> Cut:
        e0, ne = self.experts(cfg)
        cut: list = [(0, ((e0, e0 + ne),))] if self.expert_parallel else []
        if not self.expert_parallel:
            inter = cfg.moe_intermediate_size
            (i0, i1), = self._part(inter)
            if name.endswith("gate_up_proj"):
                cut.append((1, ((i0, i1), (inter + i0, inter + i1))))
            else:
                cut.append((2, ((i0, i1),)))
        return tuple(cut)
