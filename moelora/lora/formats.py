"""Every PEFT on-disk LoRA layout -> the canonical sites of `moelora.lora.adapter`.

Shape legend: H hidden, I expert intermediate, E experts, r rank (per site, per expert).

Keys are ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` (PEFT saves them without
the adapter name). ``<module>`` is one of, with ``L = model.layers.{i}``:

- dense sites, ``lora_A [r, in]``, ``lora_B [out, r]``: ``L.self_attn.{q,k,v,o}_proj``, or for
  MLA (DeepSeek) ``L.self_attn.{q_proj | q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj}``,
  ``L.mlp.{gate,up,down}_proj`` (dense layers), ``L.mlp.shared_expert.{gate,up,down}_proj`` (Qwen2),
  ``L.mlp.shared_experts.{gate,up,down}_proj`` (DeepSeek/GLM), ``L.mlp.shared_expert_gate``,
  ``L.mlp.gate`` (the router; a PEFT ``target_parameters`` wrapper of ``mlp.gate.weight`` saves
  the same keys);
- (a) per expert, 2D as above: ``L.mlp.experts.{e}.{gate,up,down}_proj``; Mixtral's and MiniMax-M2's Hub names
  ``L.block_sparse_moe.experts.{e}.{w1,w3,w2}`` (gate, up, down) and ``L.block_sparse_moe.gate``.
  Every expert must be present for a targeted projection; ranks may differ between experts
  (zero-padded to the largest);
- (b) PEFT ``target_parameters`` (``ParamWrapper``): ``L.mlp.experts.lora_{A,B}.weight`` and, when
  both expert parameters are targeted, ``L.mlp.experts.base_layer.lora_{A,B}.weight`` (PEFT 0.21
  nests ``gate_up_proj`` inside, ``down_proj`` outside; we identify each by its shapes and require
  it in ``target_parameters``). PEFT >= 0.19: ``A [E*r, in]`` expert-major, ``B [out, E*r]`` with
  ``B_e = B[:, e::E]``; PEFT < 0.19 swapped in/out for ``[E, out, in]`` parameters: ``A [E*r, out]``,
  ``B [in, E*r]``, delta ``A_e^T B_e^T``. Orientation is read from the shapes; ``peft_version``
  decides only when both orientations fit. Gate and up share one A here;
- (c) packed 3D: ``L.mlp.experts.{gate_up,gate,up,down}_proj.lora_A.weight [E, r, in]`` and
  ``.lora_B.weight [E, out, r]`` (``gate_up`` rows ``[:I]`` gate, ``[I:]`` up, as the base
  ``gate_up_proj``; or separate ``gate`` / ``up``).

``rank_pattern`` / ``alpha_pattern`` keys match module names as PEFT matches them (first key ``k``
with ``re.match(rf"(.*\\.)?({k})$", name)``), against the on-disk module name (for (b) the
parameter name ``L.mlp.experts.gate_up_proj`` / ``L.mlp.experts.down_proj``, as PEFT does). A
module's tensor rank must equal the rank its pattern gives. ``layers_to_transform`` (+
``layers_pattern``) applies, as in PEFT, to ``target_modules`` sites and not to
``target_parameters`` wrappers (experts, or the router when ``mlp.gate.weight`` is listed); a
``target_modules`` key outside those layers is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from moelora.config import ModelConfig
from moelora.errors import AdapterError
from moelora.lora.adapter import LoRAWeights

PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}
_L = r"model\.layers\.(?P<layer>\d+)\."
_KINDS = (  # (kind, pattern on the normalised module name); first full match wins
    ("attn", re.compile(_L + r"self_attn\.(?P<proj>[qkvo])_proj")),
    ("mla", re.compile(_L + r"self_attn\.(?P<proj>q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)")),
    ("shared", re.compile(_L + r"mlp\.shared_expert\.(?P<proj>gate|up|down)_proj")),
    ("shared_experts", re.compile(_L + r"mlp\.shared_experts\.(?P<proj>gate|up|down)_proj")),
    ("shared_gate", re.compile(_L + r"mlp\.shared_expert_gate")),
    ("router", re.compile(_L + r"mlp\.gate")),
    ("dense", re.compile(_L + r"mlp\.(?P<proj>gate|up|down)_proj")),
    ("expert", re.compile(_L + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj")),
    ("packed", re.compile(_L + r"mlp\.experts\.(?P<proj>gate_up|gate|up|down)_proj")),
    ("wrapper", re.compile(_L + r"mlp\.experts(?P<inner>\.base_layer)?")),
)
_MIXTRAL_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class LoRAHyperParams:
    """The ``adapter_config.json`` fields that decide ranks, scalings and which layers carry LoRA."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] = ()
    target_parameters: tuple[str, ...] = ()
    peft_version: str | None = None

    def rank_of(self, name: str) -> int:
        return int(_pattern_value(self.rank_pattern, name, self.r))

    def scaling_of(self, name: str) -> float:
        r = self.rank_of(name)
        alpha = float(_pattern_value(self.alpha_pattern, name, self.lora_alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def layer_is_transformed(self, name: str) -> bool:
        """PEFT's `layers_to_transform` test for a `target_modules` module name."""
        if self.layers_to_transform is None:
            return True
        if self.layers_pattern:
            hits = (re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name) for p in self.layers_pattern)
            match = next((m for m in hits if m), None)
        else:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        return match is not None and int(match["idx"]) in self.layers_to_transform

    def targets_parameter(self, param_key: str) -> bool:
        """PEFT's `target_parameters` test for a full parameter name."""
        return any(param_key == t or param_key.endswith("." + t) for t in self.target_parameters)

    def swapped_expert_orientation(self) -> bool:
        """True for PEFT < 0.19 (no `peft_version` means < 0.18), whose 3D wrappers swapped in/out."""
        found = re.match(r"\s*(\d+)\.(\d+)", self.peft_version or "0.0")
        return found is None or (int(found[1]), int(found[2])) < (0, 19)


def _pattern_value(patterns: Mapping[str, float], name: str, default: float) -> float:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


@dataclass
class _Module:
    """One on-disk module: its name as saved, its normalised name, and its two tensors."""

    name: str
    norm: str
    a: torch.Tensor
    b: torch.Tensor

    @property
    def key_a(self) -> str:
        return f"{PREFIX}{self.name}.lora_A.weight"

    @property
    def key_b(self) -> str:
        return f"{PREFIX}{self.name}.lora_B.weight"


def canonicalize(tensors: Mapping[str, torch.Tensor], hp: LoRAHyperParams,
                 config: ModelConfig) -> dict[str, LoRAWeights]:
    """Map every tensor of an adapter file to canonical sites; raise `AdapterError` on anything else."""
    builder = _Builder(hp, config)
    unknown: list[str] = []
    for m in _pair(tensors, config.family):
        kind, match = _classify(m.norm)
        reason = _placement_problem(kind, match, m, hp, config)
        if reason:
            unknown.append(f"{m.key_a} ({reason})")
        else:
            builder.add(m, kind, match)
    if unknown:
        more = " ..." if len(unknown) > 12 else ""
        raise AdapterError(f"adapter has {len(unknown)} key(s) moelora cannot place: "
                           + "; ".join(unknown[:12]) + more)
    sites = builder.finish()
    if not sites:
        raise AdapterError("adapter contains no LoRA weights")
    return sites


class _Builder:
    """Collects placed modules; expert factors of all three layouts meet per layer in `experts`."""

    def __init__(self, hp: LoRAHyperParams, config: ModelConfig):
        self.hp, self.config = hp, config
        self.sites: dict[str, LoRAWeights] = {}
        self.experts: dict[int, dict[str, tuple[str, torch.Tensor, torch.Tensor]]] = {}
        self.per_expert: dict[tuple[int, str], dict[int, tuple[_Module, torch.Tensor, torch.Tensor]]] = {}
        self.wrappers: dict[int, list[_Module]] = {}

    def add(self, m: _Module, kind: str, match: re.Match) -> None:
        hp, config = self.hp, self.config
        layer, proj = int(match["layer"]), match.groupdict().get("proj")
        if kind == "wrapper":  # (b), resolved per layer in finish()
            self.wrappers.setdefault(layer, []).append(m)
        elif kind == "expert":  # (a), stacked in finish() once all experts are in
            e = int(match["expert"])
            if e >= config.num_experts:
                raise AdapterError(f"expert count mismatch: {m.key_a} names expert {e}, but the model has "
                                   f"{config.num_experts} experts")
            done = self.per_expert.setdefault((layer, proj), {})
            if e in done:
                raise AdapterError(f"{m.key_a} and {done[e][0].key_a} adapt the same expert projection")
            done[e] = (m, *_dense_factors(m, _expert_dims(proj, config), hp))
        elif kind == "packed":  # (c)
            _put(self.experts, layer, proj, m.name, *_packed_factors(m, proj, hp, config))
        else:
            site = _site_name(kind, layer, proj)
            if site in self.sites:
                raise AdapterError(f"{m.key_a} adapts {site}, which another key of this adapter adapts too")
            self.sites[site] = LoRAWeights(*_dense_factors(m, _site_dims(kind, proj, config), hp))

    def finish(self) -> dict[str, LoRAWeights]:
        for (layer, proj), by_expert in self.per_expert.items():
            first = by_expert[min(by_expert)][0].name
            _put(self.experts, layer, proj, first, *_stack_experts(by_expert, self.config))
        for layer, mods in self.wrappers.items():
            for m, proj, a, b in _wrapper_factors(mods, self.hp, self.config):
                _put(self.experts, layer, proj, m.name, a, b)
        for layer, projs in self.experts.items():
            self.sites.update(_expert_sites(layer, projs, self.config))
        return self.sites


def _pair(tensors: Mapping[str, torch.Tensor], family: str) -> list[_Module]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, t in tensors.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if not key.startswith(PREFIX) or suffix is None:
            unknown.append(key)
            continue
        halves.setdefault(key[len(PREFIX):-len(suffix)], {})[_SUFFIXES[suffix]] = t
    if unknown:
        raise AdapterError(f"unknown key(s) in adapter (expected '{PREFIX}<module>.lora_A.weight' / "
                           f"'.lora_B.weight'): {', '.join(sorted(unknown)[:12])}")
    out = []
    for name, pair in sorted(halves.items()):
        if "A" not in pair or "B" not in pair:
            have, miss = ("lora_A", "lora_B") if "A" in pair else ("lora_B", "lora_A")
            raise AdapterError(f"{PREFIX}{name}.{have}.weight has no matching {miss} "
                               f"({PREFIX}{name}.{miss}.weight is missing)")
        out.append(_Module(name, _normalise(name, family), pair["A"], pair["B"]))
    return out


HUB_NAMED_EXPERTS = ("mixtral", "minimax_m2")  # families whose Hub code names the experts block_sparse_moe ... w1/w3/w2


def _normalise(name: str, family: str) -> str:
    if family not in HUB_NAMED_EXPERTS:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(\.experts\.\d+\.)(w[123])$", lambda m: m[1] + _MIXTRAL_W[m[2]], name)


def _classify(norm: str) -> tuple[str | None, re.Match | None]:
    for kind, pattern in _KINDS:
        match = pattern.fullmatch(norm)
        if match:
            return kind, match
    return None, None


def _placement_problem(kind, match, m: _Module, hp: LoRAHyperParams, config: ModelConfig) -> str | None:
    """Why this module cannot carry LoRA in this model (None when it can)."""
    if any(w in m.norm for w in ("embed_tokens", "lm_head")):
        return "embed_tokens / lm_head LoRA is not supported"
    if kind is None:
        return "not a LoRA site moelora knows"
    layer = int(match["layer"])
    if layer >= config.num_layers:
        return f"layer {layer} does not exist, the model has {config.num_layers} layers"
    sparse = config.is_sparse(layer)
    if kind == "dense" and sparse:
        return f"layer {layer} is an MoE layer, it has no dense MLP"
    if kind not in ("attn", "mla", "dense") and not sparse:
        return f"layer {layer} is a dense layer, it has no experts or router"
    if kind in ("shared", "shared_gate") and config.shared_expert_intermediate_size == 0:
        return "the model has no shared expert"
    if kind == "shared_experts" and config.shared_experts_intermediate_size == 0:
        return "the model has no shared_experts"
    if kind in ("attn", "mla"):
        problem = _attention_problem(kind, match["proj"], config)
        if problem:
            return problem
    wrapped = kind == "wrapper" or (kind == "router" and hp.targets_parameter(m.name + ".weight"))
    if not wrapped and not hp.layer_is_transformed(m.name):
        return f"layer {layer} is not in layers_to_transform={list(hp.layers_to_transform or ())}"
    return None


def _attention_problem(kind: str, proj: str, c: ModelConfig) -> str | None:
    """Why an attention projection does not exist in this model's attention (None when it does)."""
    if c.attention != "mla":
        return f"self_attn.{proj} is an MLA projection; this model's attention is GQA" if kind == "mla" else None
    if kind == "attn" and proj in ("k", "v"):
        return f"MLA attention has no {proj}_proj (keys and values come from kv_a_proj_with_mqa / kv_b_proj)"
    if kind == "attn" and proj == "q" and c.q_lora_rank is not None:
        return "this MLA model has q_a_proj / q_b_proj (q_lora_rank is set), no q_proj"
    if kind == "mla" and proj in ("q_a_proj", "q_b_proj") and c.q_lora_rank is None:
        return f"this MLA model has q_proj (q_lora_rank is None), no {proj}"
    return None


def _site_name(kind: str, layer: int, proj: str | None) -> str:
    base = f"model.layers.{layer}."
    return base + {"attn": f"self_attn.{proj}_proj", "mla": f"self_attn.{proj}", "dense": f"mlp.{proj}_proj",
                   "shared": f"mlp.shared_expert.{proj}_proj", "shared_experts": f"mlp.shared_experts.{proj}_proj",
                   "shared_gate": "mlp.shared_expert_gate", "router": "mlp.gate"}[kind]


def _mla_dims(proj: str, c: ModelConfig) -> tuple[int, int]:
    h, n, qk = c.hidden_size, c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    return {"q": (h, n * qk), "o": (n * c.v_head_dim, h), "q_a_proj": (h, c.q_lora_rank or 0),
            "q_b_proj": (c.q_lora_rank or 0, n * qk), "kv_a_proj_with_mqa": (h, c.latent_cache_dim),
            "kv_b_proj": (c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim))}[proj]


def _site_dims(kind: str, proj: str | None, c: ModelConfig) -> tuple[int, int]:
    """(in, out) of a dense site."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if kind == "mla" or (kind == "attn" and c.attention == "mla"):
        return _mla_dims(proj, c)
    if kind == "attn":
        return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h)}[proj]
    if kind in ("dense", "shared", "shared_experts"):
        inter = {"dense": c.intermediate_size, "shared": c.shared_expert_intermediate_size,
                 "shared_experts": c.shared_experts_intermediate_size}[kind]
        return (inter, h) if proj == "down" else (h, inter)
    return (h, 1) if kind == "shared_gate" else (h, c.num_experts)


def _expert_dims(proj: str, c: ModelConfig) -> tuple[int, int]:
    """(in, out) of one expert's projection."""
    h, i = c.hidden_size, c.moe_intermediate_size
    return {"gate": (h, i), "up": (h, i), "gate_up": (h, 2 * i), "down": (i, h)}[proj]


def _check_shape(key: str, t: torch.Tensor, expected: tuple[int, ...], why: str) -> None:
    if tuple(t.shape) != expected:
        raise AdapterError(f"shape mismatch for {key}: adapter has {tuple(t.shape)}, the base model needs "
                           f"{expected} ({why})")


def _dense_factors(m: _Module, dims: tuple[int, int], hp: LoRAHyperParams):
    fin, fout = dims
    r = hp.rank_of(m.name)
    why = f"r={r} from adapter_config for {m.name}"
    _check_shape(m.key_a, m.a, (r, fin), why)
    _check_shape(m.key_b, m.b, (fout, r), why)
    return m.a.float().contiguous(), m.b.float() * hp.scaling_of(m.name)


def _packed_factors(m: _Module, proj: str, hp: LoRAHyperParams, c: ModelConfig):
    fin, fout = _expert_dims(proj, c)
    e, r = c.num_experts, hp.rank_of(m.name)
    if m.a.dim() == 3 and m.a.shape[0] != e:
        raise AdapterError(f"expert count mismatch: {m.key_a} has {m.a.shape[0]} experts, "
                           f"the model has {e}")
    why = f"packed 3D layout, E={e}, r={r} from adapter_config for {m.name}"
    _check_shape(m.key_a, m.a, (e, r, fin), why)
    _check_shape(m.key_b, m.b, (e, fout, r), why)
    return m.a.float().contiguous(), m.b.float() * hp.scaling_of(m.name)


def _stack_experts(by_expert: dict[int, tuple[_Module, torch.Tensor, torch.Tensor]], c: ModelConfig,
                   rank: int | None = None):
    """Per-expert 2D factors -> a [E, r, in], b [E, out, r]; lower ranks are zero-padded (to `rank`, else the
    largest here)."""
    missing = [e for e in range(c.num_experts) if e not in by_expert]
    if missing:
        name = by_expert[min(by_expert)][0].name
        raise AdapterError(f"{name}: LoRA for expert(s) {missing} is missing; a projection targeted in one "
                           f"expert must be present in all {c.num_experts} experts")
    r = rank or max(a.shape[0] for _, a, _ in by_expert.values())
    _, a0, b0 = by_expert[0]
    a = a0.new_zeros((c.num_experts, r, a0.shape[1]))
    b = b0.new_zeros((c.num_experts, b0.shape[0], r))
    for e, (_, ae, be) in by_expert.items():
        a[e, : ae.shape[0]] = ae
        b[e, :, : be.shape[1]] = be
    return a, b


def _wrapper_factors(mods: list[_Module], hp: LoRAHyperParams, c: ModelConfig):
    """PEFT ParamWrapper tensors of one layer -> [(module, proj, a [E, r, in], b [E, out, r])]."""
    out, seen = [], set()
    for m in mods:
        proj, swapped = _identify_wrapper(m, hp, c)
        if proj in seen:
            raise AdapterError(f"{m.key_a}: both ParamWrappers of this layer have the shapes of "
                               f"experts.{proj}_proj")
        seen.add(proj)
        name = m.name.removesuffix(".base_layer") + f".{proj}_proj"
        e, r = c.num_experts, hp.rank_of(name)
        if m.a.shape[0] != e * r:
            if r and m.a.shape[0] % r == 0:
                raise AdapterError(f"expert count mismatch: {m.key_a} {tuple(m.a.shape)} holds "
                                   f"{m.a.shape[0] // r} experts of rank {r}, the model has {e}")
            raise AdapterError(f"shape mismatch for {m.key_a}: adapter has {tuple(m.a.shape)}, the base "
                               f"model needs {(e * r, m.a.shape[1])} (E={e}, r={r} for {name})")
        la, lb = m.a.float(), m.b.float()
        if swapped:  # PEFT < 0.19: delta_e = A_e^T @ B_e^T
            a, b = lb.reshape(lb.shape[0], r, e).permute(2, 1, 0), la.reshape(e, r, -1).transpose(1, 2)
        else:  # A expert-major [E*r, in]; B rank-major interleaved, B_e = B[:, e::E]
            a, b = la.reshape(e, r, -1), lb.reshape(lb.shape[0], r, e).permute(2, 0, 1)
        out.append((m, proj, a.contiguous(), b * hp.scaling_of(name)))
    return out


def _identify_wrapper(m: _Module, hp: LoRAHyperParams, c: ModelConfig) -> tuple[str, bool]:
    """Which expert parameter a ParamWrapper adapts, and whether it uses PEFT < 0.19's orientation."""
    if m.a.dim() != 2 or m.b.dim() != 2 or m.a.shape[0] != m.b.shape[1]:
        raise AdapterError(f"shape mismatch: {m.key_a} {tuple(m.a.shape)} and {m.key_b} {tuple(m.b.shape)} "
                           f"are not the 2D [E*r, in] / [out, E*r] pair of a PEFT ParamWrapper")
    fits = []
    for proj in ("gate_up", "down"):
        if not hp.targets_parameter(f"{m.name.removesuffix('.base_layer')}.{proj}_proj"):
            continue
        fin, fout = _expert_dims(proj, c)
        for swapped, (ain, bout) in ((False, (fin, fout)), (True, (fout, fin))):
            if (m.a.shape[1], m.b.shape[0]) == (ain, bout):
                fits.append((proj, swapped))
    if not fits:
        h, i = c.hidden_size, c.moe_intermediate_size
        raise AdapterError(
            f"shape mismatch for {m.key_a} {tuple(m.a.shape)} / {m.key_b} {tuple(m.b.shape)}: fits no expert "
            f"parameter listed in target_parameters={list(hp.target_parameters)} (gate_up_proj needs "
            f"[E*r, {h}] / [{2 * i}, E*r], down_proj [E*r, {i}] / [{h}, E*r])")
    if len(fits) > 1:  # square: both orientations fit; the PEFT version decides
        swapped = hp.swapped_expert_orientation()
        fits = [f for f in fits if f[1] == swapped]
    return fits[0]


def _put(experts, layer: int, proj: str, source: str, a: torch.Tensor, b: torch.Tensor) -> None:
    projs = experts.setdefault(layer, {})
    clash = [p for p in projs if p == proj or {p, proj} in ({"gate_up", "gate"}, {"gate_up", "up"})]
    if clash:
        raise AdapterError(f"layer {layer} experts: {source} and {projs[clash[0]][0]} both adapt "
                           f"experts.{proj}_proj")
    projs[proj] = (source, a, b)


def _expert_sites(layer: int, projs: dict, c: ModelConfig) -> dict[str, LoRAWeights]:
    """gate / up / gate_up / down factors of one layer -> the two canonical expert sites."""
    base = f"model.layers.{layer}.mlp.experts."
    sites = {}
    if "down" in projs:
        sites[base + "down"] = LoRAWeights(a=projs["down"][1], b=projs["down"][2])
    if "gate_up" in projs:
        sites[base + "gate_up"] = LoRAWeights(a=projs["gate_up"][1], b=projs["gate_up"][2])
    elif "gate" in projs or "up" in projs:
        halves = [projs.get("gate"), projs.get("up")]
        a = torch.cat([h[1] for h in halves if h], dim=1)
        i = c.moe_intermediate_size
        b = a.new_zeros((c.num_experts, 2 * i, a.shape[1]))
        col = 0
        for row, half in zip((0, i), halves, strict=True):
            if half:
                hb = half[2]
                b[:, row:row + i, col:col + hb.shape[2]] = hb
                col += hb.shape[2]
        sites[base + "gate_up"] = LoRAWeights(a=a, b=b)
    return sites
