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
- intermediate splits (dense MLP, shared experts, TP's routed experts) are even, except on block-FP8 weights
  (`unit`: the scale block, 128): there each rank keeps whole blocks, as evenly as the blocks allow, the first
  ranks one more (moe_intermediate_size 1408 = 11 blocks at TP=4: 384 / 384 / 384 / 256 rows), so its blocks are
  the checkpoint's (`scales.py`) and nothing is re-quantized or padded; the last rank may end on a partial block.
  vLLM and SGLang refuse these splits (`... is not divisible by weight quantization block_n = 128`): Qwen3-235B-
  A22B-FP8 or MiniMax-M2 at TP=8 (1536 / 8 = 192), Qwen3-30B-A3B-FP8 at TP=4, GLM-4.5(-Air)-FP8 at TP=2..8;
- vocab-parallel: embed_tokens / lm_head rows [r ceil(V/N), ...), the last rank padded with zero rows;
- row-parallel biases (MLA o_proj with attention_bias): rank 0 holds them, the others zeros;
- replicated: norms, routers (and their correction bias), Qwen2's shared_expert_gate, MLA's q_a_proj and
  kv_a_proj_with_mqa (the latent is computed whole on every rank and cached per rank).
LoRA follows its weight (contract 9): an output-row cut applies to B's rows, an input-column cut to A's
columns, an expert cut to both (`adapters.py`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from moelora.config import ModelConfig
from moelora.errors import ConfigError
from moelora.quant.config import FP8Config

Cut = tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # ((dim, ((start, stop), ...)), ...)

_SHARED = re.compile(r"\.mlp\.(shared_experts?)\.(gate_proj|up_proj|down_proj)\.weight$")
_DENSE = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")


def split_unit(fp8: FP8Config | None) -> int | None:
    """`ShardPlan.unit` for a model whose weights are `fp8`: a block-FP8 scale block's rows and columns (an
    intermediate dim is gate_up's rows and down's columns), None (even splits) for the others."""
    return math.lcm(*fp8.block) if fp8 is not None and fp8.weights == "block" else None


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`; `expert_parallel`: routed experts partitioned (else split inside); `unit`: the
    intermediate dims are split in whole units of this many rows, unevenly if need be (block-FP8's 128:
    `split_unit`), None: evenly."""

    rank: int
    size: int
    expert_parallel: bool = False
    unit: int | None = None

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
        def split(value: int, what: str, hint: str = "") -> None:
            if self.unit is None:
                return need(value, what, hint)
            units = -(-value // self.unit)
            if units < n:
                raise ConfigError(f"tensor_parallel_size={n} cannot split {what}={value}: its FP8 weights hold "
                                  f"{units} scale block(s) of {self.unit} rows and each rank keeps whole blocks, "
                                  f"at least one{hint or ''}")
        if self.has_dense_layers(cfg):
            split(cfg.intermediate_size, "intermediate_size (dense MLP)")
        if self.expert_parallel:
            need(cfg.num_experts, "num_experts", " (expert parallelism partitions the routed experts)")
        else:
            split(cfg.moe_intermediate_size, "moe_intermediate_size",
                  " (or partition the experts instead: --enable-expert-parallel)")
        if cfg.shared_expert_intermediate_size:
            split(cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        if cfg.shared_experts_intermediate_size:
            split(cfg.shared_experts_intermediate_size, "moe_intermediate_size * n_shared_experts (shared experts)")

    @staticmethod
    def has_dense_layers(cfg: ModelConfig) -> bool:
        return any(not cfg.is_sparse(i) for i in range(cfg.num_layers))

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

        def rows(full: int) -> int:
            (lo, hi), = self._part(full)
            return hi - lo
        dense = rows(cfg.intermediate_size) if self.has_dense_layers(cfg) else (
            cfg.intermediate_size // n if cfg.intermediate_size % n == 0 else 0)  # unused: no dense layer
        return dataclasses.replace(
            cfg, num_heads=cfg.num_heads // n, num_kv_heads=self.kv_heads(cfg)[1], intermediate_size=dense,
            moe_intermediate_size=cfg.moe_intermediate_size if self.expert_parallel else rows(
                cfg.moe_intermediate_size),
            shared_expert_intermediate_size=rows(cfg.shared_expert_intermediate_size),
            shared_experts_intermediate_size=rows(cfg.shared_experts_intermediate_size))

    def drops(self, name: str) -> bool:
        """Whether this rank holds zeros for replicated tensor `name`: a row-parallel projection's bias
        (MLA's o_proj with attention_bias), added by rank 0 alone so the all-reduce adds it once."""
        return self.rank > 0 and name.endswith(".self_attn.o_proj.bias")

    # cuts ---------------------------------------------------------------------------------------
    def _rows(self, first: int, count: int, width: int) -> tuple[tuple[int, int], ...]:
        return ((first * width, (first + count) * width),)

    def _part(self, full: int) -> tuple[tuple[int, int], ...]:
        """This rank's rows of an intermediate dim of `full` rows: 1/N of them, or whole `unit`s of them
        (the first `units % N` ranks one more; the last range cut at `full`)."""
        unit = self.unit or max(full // self.size, 1)
        per, extra = divmod(-(-full // unit), self.size)
        first = self.rank * per + min(self.rank, extra)
        count = per + (self.rank < extra)
        return ((min(first * unit, full), min((first + count) * unit, full)),)

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
