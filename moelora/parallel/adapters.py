"""An adapter cut to one rank's shard: LoRA shards with its base weight (contract 9).

For a site whose base weight W [.., out, in] has a cut (`rules.ShardPlan.cut`): a cut of the output dim
keeps those rows of B [.., out, r] and all of A (column-parallel: A whole, B split by output); a cut of the
input dim keeps those columns of A [.., r, in] and all of B (row-parallel: each rank adds (x_i A_i) B to
its partial sum before the base all-reduce); a cut of a leading (expert) dim keeps those experts of both
(routed-expert LoRA lives with its expert). Site ranks are unchanged, so every rank turns the same sites
on and the step's `LoRABatch` (slots, ranks) is the same everywhere.
"""

from __future__ import annotations

from moelora.config import ModelConfig
from moelora.lora.adapter import LoRAAdapter, LoRAWeights
from moelora.parallel.rules import ShardPlan
from moelora.parallel.shard import apply_cut


def weight_name(site: str) -> str:
    """The base weight a site's delta is added to."""
    if site.endswith((".mlp.experts.gate_up", ".mlp.experts.down")):
        return site + "_proj"
    return site + ".weight"


def shard_adapter(adapter: LoRAAdapter, plan: ShardPlan, cfg: ModelConfig) -> LoRAAdapter:
    """`adapter` (full, canonical) as rank `plan.rank` holds it (copies: the full tensors are not kept)."""
    if plan.size == 1:
        return adapter
    sites = {}
    for key, w in adapter.sites.items():
        cut = plan.cut(weight_name(key), cfg)
        a, b = w.a, w.b
        if cut is not None:
            out_dim, in_dim = a.dim() - 2, a.dim() - 1
            a = apply_cut(a, tuple(c for c in cut if c[0] != out_dim)).clone()  # leading dims and input: A's
            b = apply_cut(b, tuple(c for c in cut if c[0] != in_dim)).clone()  # leading dims and output: B's
        sites[key] = LoRAWeights(a, b)
    return LoRAAdapter(adapter.name, adapter.path, sites)

