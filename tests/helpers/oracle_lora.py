"""Real PEFT LoRA adapters on the tiny oracle models, and the oracles that apply them (no hub).

Three on-disk layouts (see `moelora.lora.formats`):
- (a) per expert: `per_expert_lora` draws random non-zero factors for every site, PEFT-named
  (`...mlp.experts.{e}.gate_proj`, or Mixtral Hub `...block_sparse_moe.experts.{e}.w1`);
  `write_adapter` saves them in PEFT's format. PEFT cannot target the fused 3D experts with
  `target_modules`, so these are written by hand; `merged_model` is their oracle
  (W += scale * B @ A on a deep copy).
- (b) real PEFT: `build_peft_adapter` runs `get_peft_model` with `target_parameters` for the experts
  and `save_pretrained`; `peft_model` / `peft_deltas` / `oracle_logits` apply it through PEFT.
  PEFT's transformers-5 target rewrite is disabled (`no_moe_target_rewrite`).
- (c) packed 3D: `write_packed` writes the same factors as `[E, r, in]` / `[E, out, r]`.
`peft_to_raw` turns a (b) adapter into per-expert factors, so one set of weights exists in all three.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moelora.verify import no_moe_target_rewrite

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_HF_PREFIX = "base_model.model."
_EXPERT_NAME = re.compile(r"(?P<block>.*)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


# PEFT 0.21 rewrites MoE target_modules silently; the oracle disables that (see moelora.verify).


def moelora_config(model):
    """The `ModelConfig` of a tiny HF model (its config lacks `architectures`)."""
    from moelora.config import ModelConfig

    raw = model.config.to_dict()
    raw["architectures"] = [type(model).__name__]
    return ModelConfig.from_dict(raw)


def peft_scale(config: dict, name: str, rank: int | None = None) -> tuple[int, float]:
    """(rank, scaling) PEFT gives module/parameter `name` under adapter `config` (PEFT's own matcher)."""
    from peft.utils.other import get_pattern_key

    rp, ap = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    r = rp.get(get_pattern_key(rp.keys(), name), config["r"]) if rank is None else rank
    alpha = ap.get(get_pattern_key(ap.keys(), name), config["lora_alpha"])
    return r, alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _alpha_for(scale: float, r: int, rslora: bool) -> float:
    return scale * math.sqrt(r) if rslora else scale * r


@dataclass
class RawLoRA:
    """LoRA factors by PEFT module name: name -> (A [r, in], B [out, r], scaling), and adapter_config."""

    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    config: dict = field(default_factory=dict)


def adapter_config(**fields) -> dict:
    """A PEFT LoRA adapter_config.json dict with PEFT's defaults for the fields moelora reads."""
    import peft

    base = dict(peft_type="LORA", r=4, lora_alpha=8, use_rslora=False, rank_pattern={}, alpha_pattern={},
                bias="none", use_dora=False, modules_to_save=None, target_modules=[], target_parameters=None,
                layers_to_transform=None, layers_pattern=None, lora_dropout=0.0,
                peft_version=peft.__version__)
    base.update(fields)
    return base


def _lora_targets(model, *, router: bool, hub_names: bool) -> list[tuple[str, int, int]]:
    """(PEFT module name, in, out) of every LoRA site of `model`, experts one by one."""
    out = []
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Linear) and (leaf in ATTN + MLP or leaf == "shared_expert_gate"):
            out.append((name, mod.in_features, mod.out_features))
        elif router and leaf == "gate" and name.endswith("mlp.gate"):
            e, h = mod.weight.shape
            out.append((name.replace(".mlp.", ".block_sparse_moe.") if hub_names else name, h, e))
        elif isinstance(getattr(mod, "gate_up_proj", None), torch.nn.Parameter):
            num_e, two_i, h = mod.gate_up_proj.shape
            block = name.replace(".mlp.", ".block_sparse_moe.") if hub_names else name
            names = ("w1", "w3", "w2") if hub_names else MLP
            i = two_i // 2
            for e in range(num_e):
                out += [(f"{block}.{e}.{names[0]}", h, i), (f"{block}.{e}.{names[1]}", h, i),
                        (f"{block}.{e}.{names[2]}", i, h)]
    return out


def per_expert_lora(model, *, seed: int = 0, r: int = 4, lora_alpha: float = 8, use_rslora: bool = False,
                    rank_pattern: dict | None = None, alpha_pattern: dict | None = None,
                    layers_to_transform: list[int] | None = None, router: bool = True, experts: bool = True,
                    hub_names: bool = False, std: float = 0.2) -> RawLoRA:
    """Random non-zero per-expert LoRA (layout (a)) on every site of `model`."""
    config = adapter_config(r=r, lora_alpha=lora_alpha, use_rslora=use_rslora,
                            rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
                            layers_to_transform=layers_to_transform)
    g = torch.Generator().manual_seed(seed)
    factors, leaves = {}, set()
    for name, fin, fout in _lora_targets(model, router=router, hub_names=hub_names):
        layer = int(name.split("layers.")[1].split(".")[0])
        if (layers_to_transform is not None and layer not in layers_to_transform) or (
                not experts and _EXPERT_NAME.fullmatch(name)):
            continue
        rank, scale = peft_scale(config, name)
        a = std * torch.randn(rank, fin, generator=g)
        b = std * torch.randn(fout, rank, generator=g)
        factors[name] = (a, b, scale)
        leaves.add(name.rsplit(".", 1)[-1])
    config["target_modules"] = sorted(leaves)
    return RawLoRA(factors, config)


def write_adapter(out_dir, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Save `tensors` (full keys) and `config` as a PEFT adapter directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().clone().contiguous() for k, v in tensors.items()}  # no shared storage
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out


def raw_tensors(raw: RawLoRA) -> dict[str, torch.Tensor]:
    """PEFT keys of per-module factors (layout (a))."""
    out = {}
    for name, (a, b, _) in raw.factors.items():
        out[f"{_HF_PREFIX}{name}.lora_A.weight"] = a
        out[f"{_HF_PREFIX}{name}.lora_B.weight"] = b
    return out


def write_per_expert(raw: RawLoRA, out_dir) -> Path:
    return write_adapter(out_dir, raw_tensors(raw), raw.config)


def write_packed(raw: RawLoRA, out_dir, *, fuse_gate_up: bool = True) -> Path:
    """Layout (c): experts as `...mlp.experts.{gate_up|gate|up|down}_proj.lora_{A,B}.weight` 3D tensors.

    Exact rank/alpha patterns for the packed names are put first, so each keeps the scaling it had.
    """
    dense = RawLoRA({n: f for n, f in raw.factors.items() if not _EXPERT_NAME.fullmatch(n)})
    tensors = raw_tensors(dense)
    groups: dict[tuple[str, str], dict[int, tuple]] = {}
    for name, f in raw.factors.items():
        m = _EXPERT_NAME.fullmatch(name)
        if m:
            groups.setdefault((m["block"], _PROJ[m["proj"]]), {})[int(m["e"])] = f
    rslora, ranks, alphas = bool(raw.config.get("use_rslora")), {}, {}
    packed: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    for (block, proj), by_e in groups.items():
        fs = [by_e[e] for e in sorted(by_e)]
        if len({(f[0].shape, f[2]) for f in fs}) != 1:
            raise ValueError(f"{block} {proj}: packing needs one rank and scaling for all experts")
        packed[(block, proj)] = (torch.stack([f[0] for f in fs]), torch.stack([f[1] for f in fs]), fs[0][2])
    for block in sorted({blk for blk, _ in packed}):
        projs = {p: packed[(block, p)] for p in ("gate", "up", "down") if (block, p) in packed}
        if fuse_gate_up and "gate" in projs and "up" in projs and projs["gate"][2] == projs["up"][2]:
            (ag, bg, s), (au, bu, _) = projs.pop("gate"), projs.pop("up")
            b = torch.zeros(bg.shape[0], bg.shape[1] + bu.shape[1], ag.shape[1] + au.shape[1])
            b[:, : bg.shape[1], : ag.shape[1]] = bg
            b[:, bg.shape[1]:, ag.shape[1]:] = bu
            projs["gate_up"] = (torch.cat([ag, au], dim=1), b, s)
        for proj, (a, b, s) in projs.items():
            name = f"{block}.mlp.experts.{proj}_proj"
            tensors[f"{_HF_PREFIX}{name}.lora_A.weight"] = a
            tensors[f"{_HF_PREFIX}{name}.lora_B.weight"] = b
            ranks[re.escape(name)] = a.shape[1]
            alphas[re.escape(name)] = _alpha_for(s, a.shape[1], rslora)
    config = dict(raw.config, rank_pattern={**ranks, **(raw.config.get("rank_pattern") or {})},
                  alpha_pattern={**alphas, **(raw.config.get("alpha_pattern") or {})})
    return write_adapter(out_dir, tensors, config)


def merged_model(model, raw: RawLoRA):
    """Manual-merge oracle: a deep copy of `model` with W += scale * B @ A for every module of `raw`."""
    merged = copy.deepcopy(model)
    with torch.no_grad():
        for name, (a, b, s) in raw.factors.items():
            delta = s * (b.double() @ a.double())
            m = _EXPERT_NAME.fullmatch(name)
            if m is None:
                weight = merged.get_submodule(name.replace(".block_sparse_moe.", ".mlp.")).weight
                weight += delta.to(weight.dtype)
                continue
            experts = merged.get_submodule(f"{m['block']}.mlp.experts")
            e, proj = int(m["e"]), _PROJ[m["proj"]]
            i = experts.gate_up_proj.shape[1] // 2
            if proj == "down":
                experts.down_proj[e] += delta.to(experts.down_proj.dtype)
            else:
                rows = slice(0, i) if proj == "gate" else slice(i, 2 * i)
                experts.gate_up_proj[e, rows] += delta.to(experts.gate_up_proj.dtype)
    return merged


def param_site(param_name: str) -> str | None:
    """The canonical moelora site a base parameter belongs to (None: no LoRA site)."""
    if param_name.endswith(".experts.gate_up_proj"):
        return param_name[: -len("_proj")]
    if param_name.endswith(".experts.down_proj"):
        return param_name[: -len("_proj")]
    if not param_name.endswith(".weight") or "norm" in param_name or ".layers." not in param_name:
        return None
    return param_name[: -len(".weight")]


def weight_deltas(base, merged) -> dict[str, torch.Tensor]:
    """merged - base for every parameter that has a LoRA site, by site name."""
    mp = dict(merged.named_parameters())
    return {param_site(n): (mp[n].detach().double() - p.detach().double())
            for n, p in base.named_parameters() if param_site(n)}


def build_peft_adapter(model, out_dir, *, seed: int = 0, r: int = 4, lora_alpha: float = 8,
                       use_rslora: bool = False, rank_pattern: dict | None = None,
                       alpha_pattern: dict | None = None, layers_to_transform: list[int] | None = None,
                       target_modules: tuple[str, ...] | None = None,
                       target_parameters: tuple[str, ...] = EXPERT_PARAMS, router: bool = False,
                       std: float = 0.2, peft_rewrite: bool = False) -> Path:
    """Layout (b): a real PEFT adapter (random non-zero A and B) saved with save_pretrained.

    `peft_rewrite=True` keeps PEFT's MoE target rewrite on (what users of PEFT 0.21 get by default).
    """
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    if target_modules is None:
        target_modules = ATTN + MLP + (("shared_expert_gate",) if _has(model, "shared_expert_gate") else ())
    params = tuple(target_parameters) + (("mlp.gate.weight",) if router else ())
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, use_rslora=use_rslora, rank_pattern=rank_pattern or {},
                     alpha_pattern=alpha_pattern or {}, layers_to_transform=layers_to_transform,
                     target_modules=list(target_modules), target_parameters=list(params) or None)
    with contextlib.nullcontext() if peft_rewrite else no_moe_target_rewrite():
        pm = get_peft_model(copy.deepcopy(model), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_A." in n or ".lora_B." in n:
                p.copy_(std * torch.randn(p.shape, generator=g))
    pm.save_pretrained(str(out_dir))
    saved = json.loads((Path(out_dir) / "adapter_config.json").read_text())
    keys = load_file(str(Path(out_dir) / "adapter_model.safetensors"))
    if peft_rewrite:
        return Path(out_dir)
    if set(saved["target_modules"]) != set(target_modules):
        raise RuntimeError(f"PEFT rewrote target_modules to {saved['target_modules']}")
    if _has(model, "shared_expert") and "up_proj" in target_modules and not any(
            ".shared_expert.up_proj.lora_A" in k for k in keys):
        raise RuntimeError("PEFT dropped the shared-expert LoRA")
    return Path(out_dir)


def _has(model, leaf: str) -> bool:
    return any(n.endswith("." + leaf) for n, _ in model.named_modules())


def peft_model(model, adapter_dir):
    """A fresh deep copy of `model` with the adapter applied by PEFT (rewrite disabled), in eval mode."""
    from peft import PeftModel

    with no_moe_target_rewrite():
        return PeftModel.from_pretrained(copy.deepcopy(model), str(adapter_dir)).eval()


def peft_deltas(model, adapter_dir) -> dict[str, torch.Tensor]:
    """PEFT's own `get_delta_weight` of every adapted module / parameter, by canonical site name."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    out = {}
    for name, mod in peft_model(model, adapter_dir).named_modules():
        if not isinstance(mod, LoraLayer) or "default" not in mod.lora_A:
            continue
        name = name.removeprefix(_HF_PREFIX).replace(".base_layer", "")
        if isinstance(mod, ParamWrapper):
            name = param_site(f"{name}.{mod.parameter_name}")
        out[name] = mod.get_delta_weight("default").detach().double()
    return out


def peft_to_raw(adapter_dir, model) -> RawLoRA:
    """The per-expert factors (layout (a)) of a real PEFT adapter: gate and up share A_e, B_e = B[:, e::E].

    PEFT 0.21 nests the `gate_up_proj` wrapper inside (`experts.base_layer`) and `down_proj` outside
    (`experts`) when both are targeted. Every module gets an exact rank/alpha pattern.
    """
    from safetensors.torch import load_file

    root = Path(adapter_dir)
    config = json.loads((root / "adapter_config.json").read_text())
    sd = load_file(str(root / "adapter_model.safetensors"))
    params = sorted({p.rsplit(".", 1)[-1] for p in config.get("target_parameters") or ()} & {"gate_up_proj",
                                                                                            "down_proj"})
    factors = {}
    for key in sorted(k for k in sd if k.endswith(".lora_A.weight")):
        name = key[len(_HF_PREFIX): -len(".lora_A.weight")]
        a, b = sd[key], sd[key.replace("lora_A", "lora_B")]
        if not re.search(r"\.experts(\.base_layer)?$", name):
            factors[name] = (a, b, peft_scale(config, name, a.shape[0])[1])
            continue
        inner = name.endswith(".base_layer")
        proj = ("gate_up_proj" if inner else "down_proj") if len(params) == 2 else params[0]
        block = name.removesuffix(".base_layer")
        experts = model.get_submodule(block)
        num_e, i = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[1] // 2
        r = a.shape[0] // num_e
        scale = peft_scale(config, f"{block}.{proj}", r)[1]
        for e in range(num_e):
            ae, be = a[e * r:(e + 1) * r], b[:, e::num_e]
            if proj == "down_proj":
                factors[f"{block}.{e}.down_proj"] = (ae, be, scale)
            else:
                factors[f"{block}.{e}.gate_proj"] = (ae, be[:i], scale)
                factors[f"{block}.{e}.up_proj"] = (ae, be[i:], scale)
    rslora = bool(config.get("use_rslora"))
    out = adapter_config(r=config["r"], lora_alpha=config["lora_alpha"], use_rslora=rslora,
                         target_modules=sorted({n.rsplit(".", 1)[-1] for n in factors}),
                         rank_pattern={re.escape(n): f[0].shape[0] for n, f in factors.items()},
                         alpha_pattern={re.escape(n): _alpha_for(f[2], f[0].shape[0], rslora)
                                        for n, f in factors.items()})
    return RawLoRA(factors, out)


def oracle_logits(model, input_ids: torch.Tensor, *, adapter_dir=None, raw: RawLoRA | None = None):
    """Logits of `model` on `input_ids` [B, T] with an adapter applied through PEFT (`adapter_dir`) or
    by manual merge (`raw`); neither: the base model."""
    if adapter_dir is not None and raw is not None:
        raise ValueError("give adapter_dir or raw, not both")
    if adapter_dir is not None:
        target = peft_model(model, adapter_dir)
    else:
        target = model if raw is None else merged_model(model, raw)
    with torch.no_grad():
        return target(input_ids).logits


def old_peft_orientation(path, model, out, peft_version):
    """Rewrite a (b) adapter in PEFT < 0.19's orientation: A [E*r, out], B [in, E*r], delta_e = A_e^T B_e^T.
    """
    from safetensors.torch import load_file

    sd = load_file(str(path / "adapter_model.safetensors"))
    cfg = json.loads((path / "adapter_config.json").read_text())
    e = moelora_config(model).num_experts
    wrappers = ("experts.lora_A.weight", "experts.base_layer.lora_A.weight")
    for key in [k for k in sd if k.endswith(wrappers)]:
        a, b = sd[key], sd[key.replace("lora_A", "lora_B")]
        r = a.shape[0] // e
        a_e, b_e = a.reshape(e, r, -1), b.reshape(b.shape[0], r, e).permute(2, 0, 1)  # [E,r,in], [E,out,r]
        old_a = b_e.transpose(1, 2).reshape(e * r, -1)  # A_e = b_e^T
        old_b = a_e.permute(2, 1, 0).reshape(a.shape[1], r * e)  # B[:, j*E + e] = a_e[j]
        # PEFT 0.18's get_delta_weight, "o r e, e r i -> e i o", must give the same [E, out, in] delta
        old = torch.einsum("ore,eri->eio", old_b.reshape(-1, r, e), old_a.reshape(e, r, -1))
        torch.testing.assert_close(old, b_e @ a_e)
        sd[key], sd[key.replace("lora_A", "lora_B")] = old_a.contiguous(), old_b.contiguous()
    cfg["peft_version"] = peft_version
    return write_adapter(out, sd, cfg)
