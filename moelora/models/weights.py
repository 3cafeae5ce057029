"""Streaming, strict loading of a base-model checkpoint into preallocated tensors (contract 7).

Accepted on-disk forms (safetensors only; `.bin`/`.pt` checkpoints are refused):

- files: a single `model.safetensors`, or shards listed by `model.safetensors.index.json`;
- fused experts, as transformers 5 holds them in memory (`save_pretrained(...,
  save_original_format=False)`): `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H] (rows
  [:I] gate, [I:] up) and `model.layers.{i}.mlp.experts.down_proj` [E, H, I];
- Hub-style per-expert keys (what `save_pretrained` writes by default):
  `model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight` ([I,H], [I,H], [H,I]);
- Mixtral Hub spelling: `model.layers.{i}.block_sparse_moe.gate.weight` (router) and
  `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (gate, up, down); MiniMax-M2's router correction bias
  `block_sparse_moe.e_score_correction_bias` (transformers 5 in memory: `mlp.e_score_correction_bias`), which
  moelora's router holds as `mlp.gate.e_score_correction_bias`.

Every other key must equal a moelora (= transformers 5 in-memory) parameter name. Per-expert
tensors are copied straight into their slice of the fused destination; nothing is held twice.

DeepSeek/GLM names need no mapping: `mlp.shared_experts.*`, `mlp.gate.weight` and
`mlp.gate.e_score_correction_bias` are the in-memory names, and their per-expert keys are the Hub
form above. Destinations keep their own dtype (the fp32 router weight and correction bias stay fp32).

Strictness: every checkpoint key must land somewhere and every destination element (every expert
slice) must be written exactly once, with the right shape; otherwise `CheckpointError`. All of that
is checked from the safetensors headers before any tensor data is read. Three kinds of key are
ignored: rotary-embedding buffers (`rotary_emb.inv_freq`), which are not weights;
`lm_head.weight` when the caller passes no `lm_head.weight` (tied embeddings) and its shape equals
`model.embed_tokens.weight` -- transformers also drops that copy and ties the head to the embedding;
and the multi-token-prediction layers DeepSeek-V3 / GLM-4.5 / MiniMax-M2 ship after the decoder
(`model.layers.{k}.*` with k past the last decoder layer: all of them when the checkpoint holds an
`eh_proj.weight` in one of those layers, else the ones config.json declares, `num_nextn_predict_layers` or
MiniMax's `num_mtp_modules`), which moelora does not run -- as transformers ignores them.

FP8 checkpoints (`quant`, a `moelora.quant.checkpoint.FP8Loading`): every FP8 weight key has a scale key
next to it (`X.weight_scale_inv`, per-expert `...experts.{e}.gate_proj.weight_scale_inv`, fused
`experts.gate_up_proj_scale_inv`; compressed-tensors' `weight_scale`), mapped, checked and copied like any
other tensor; dtypes are checked too, and quantize-on-load writes a weight's scale with it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from moelora.errors import CheckpointError
from moelora.quant.checkpoint import SCALE, FP8Loading, is_scale, scale_name

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"
LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
_SHOW_MISSING = 8

_IGNORED = re.compile(r"(^|\.)rotary_emb\.(original_)?inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_MARK = "eh_proj.weight"  # the embedding/hidden projection only a multi-token-prediction layer has
_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?)(?:mlp\.experts\.(?P<e1>\d+)\.(?P<hub>gate_proj|up_proj|down_proj)"
    r"|block_sparse_moe\.experts\.(?P<e2>\d+)\.(?P<mix>w1|w3|w2))\.(?P<param>weight(?:_scale_inv)?)$"
)
# MiniMax-M2's correction bias on the MoE block (Hub and transformers 5 spellings), not on its router
_BLOCK_BIAS = re.compile(r"^(?P<prefix>.*\.)(?:block_sparse_moe|mlp)\.e_score_correction_bias$")
# projection spelling -> (fused destination suffix, half: 0 = gate rows, 1 = up rows, None = all)
_PROJ = {"gate_proj": (GATE_UP, 0), "up_proj": (GATE_UP, 1), "down_proj": (DOWN, None),
         "w1": (GATE_UP, 0), "w3": (GATE_UP, 1), "w2": (DOWN, None)}
_SPELLING = {"hub": {0: "gate_proj", 1: "up_proj", None: "down_proj"},
             "mixtral": {0: "w1", 1: "w3", None: "w2"}}


class KeyTarget(NamedTuple):
    """Where one checkpoint tensor goes: `name`, then expert `expert` (None: the whole tensor),
    then row half `half` of that expert (0: gate rows [:I], 1: up rows [I:], None: all rows)."""

    name: str
    expert: int | None = None
    half: int | None = None


def map_checkpoint_key(key: str) -> KeyTarget | None:
    """The destination of checkpoint key `key`, or None for a known non-weight buffer. Pure."""
    if _IGNORED.search(key):
        return None
    m = _PER_EXPERT.match(key)
    if m:
        proj = m["hub"] or m["mix"]
        suffix, half = _PROJ[proj]
        scale = SCALE if m["param"] != "weight" else ""
        return KeyTarget(m["prefix"] + suffix + scale, int(m["e1"] or m["e2"]), half)
    if ".block_sparse_moe.gate." in key:
        return KeyTarget(key.replace(".block_sparse_moe.gate.", ".mlp.gate."))
    m = _BLOCK_BIAS.match(key)
    if m:
        return KeyTarget(f"{m['prefix']}mlp.gate.e_score_correction_bias")
    return KeyTarget(key)


def checkpoint_key(target: KeyTarget, style: str) -> str:
    """The on-disk spelling of `target` in `style` ("fused", "hub" or "mixtral"); inverse of
    `map_checkpoint_key`. Pure."""
    name = target.name
    if style == "mixtral" and name.endswith(".mlp.gate.weight"):
        return name[: -len("mlp.gate.weight")] + "block_sparse_moe.gate.weight"
    if style == "mixtral" and name.endswith(".mlp.gate.e_score_correction_bias"):
        return name[: -len("mlp.gate.e_score_correction_bias")] + "block_sparse_moe.e_score_correction_bias"
    if target.expert is None:
        return name
    scale = SCALE if is_scale(name) else ""
    name = _weight_of(name)
    prefix = name[: -len(GATE_UP if name.endswith(GATE_UP) else DOWN)]
    proj = _SPELLING[style][target.half]
    block = "block_sparse_moe" if style == "mixtral" else "mlp"
    return f"{prefix}{block}.experts.{target.expert}.{proj}.weight{scale}"


def _weight_of(name: str) -> str:
    """The weight a destination belongs to (an FP8 scale's weight, or the name itself)."""
    return name[: -len(SCALE)] if is_scale(name) else name


def _is_fused_experts(name: str, dest: torch.Tensor) -> bool:
    return dest.dim() == 3 and _weight_of(name).endswith((GATE_UP, DOWN))


def _units(name: str, dest: torch.Tensor, target: KeyTarget) -> set:
    """The pieces of `dest` that `target` writes (a fused expert tensor has one per expert/half)."""
    if not _is_fused_experts(name, dest):
        return {None}
    if target.expert is not None:
        return {(target.expert, target.half)}
    halves = (0, 1) if _weight_of(name).endswith(GATE_UP) else (None,)
    return {(e, h) for e in range(dest.shape[0]) for h in halves}


def _destination_view(dest: torch.Tensor, target: KeyTarget) -> torch.Tensor:
    if target.expert is None:
        return dest
    view = dest[target.expert]
    if target.half is None:
        return view
    assert view.shape[0] % 2 == 0, "a fused gate_up destination has 2I rows"
    rows = view.shape[0] // 2
    return view[:rows] if target.half == 0 else view[rows:]


def _shard_files(model_dir: Path) -> dict[Path, set[str] | None]:
    """The safetensors files to read, each with the keys the index promises in it (None: any)."""
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files: dict[Path, set[str] | None] = {}
        for key, fname in weight_map.items():
            files.setdefault(model_dir / fname, set()).add(key)
        missing = sorted(str(p.name) for p in files if not p.is_file())
        if missing:
            raise CheckpointError(f"{index} lists shard(s) missing from {model_dir}: {missing}")
        if not files:
            raise CheckpointError(f"{index} lists no tensors")
        return dict(sorted(files.items()))
    if (model_dir / SINGLE_FILE).is_file():
        return {model_dir / SINGLE_FILE: None}
    others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if others:
        raise CheckpointError(f"{model_dir} holds only {others}: only safetensors checkpoints are "
                              f"supported (convert with safetensors' torch.save_file)")
    stray = sorted(p.name for p in model_dir.glob("*.safetensors"))
    hint = f"; found {stray} but no {INDEX_FILE}" if stray else ""
    raise CheckpointError(f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _read_headers(files: dict[Path, set[str] | None], dtypes: dict[str, str] | None = None
                  ) -> dict[Path, dict[str, tuple[int, ...]]]:
    """Key -> shape of every tensor in every file (headers only, no tensor data); `dtypes`, if given,
    receives key -> safetensors dtype name."""
    from safetensors import safe_open

    headers = {}
    for path, promised in files.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
                if dtypes is not None:
                    dtypes.update((k, f.get_slice(k).get_dtype()) for k in f.keys())
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read safetensors file {path}: {exc}") from exc
        absent = sorted((promised or set()) - shapes.keys())
        if absent:
            raise CheckpointError(f"{path.name} lacks {len(absent)} tensor(s) that {INDEX_FILE} "
                                  f"places there, e.g. {absent[:_SHOW_MISSING]}")
        headers[path] = shapes
    if not any(headers.values()):
        raise CheckpointError(f"no tensors in {sorted(str(p) for p in files)}")
    return headers


def _checkpoint_style(keys) -> str:
    """How the checkpoint spells experts, so that missing keys are named as it would name them."""
    keys = list(keys)
    if any(".block_sparse_moe." in k for k in keys):
        return "mixtral"
    if any(_PER_EXPERT.match(k) for k in keys):
        return "hub"
    return "fused"


def _target_of(key: str, shape: tuple[int, ...], params: dict[str, torch.Tensor],
               quant: FP8Loading | None = None) -> KeyTarget | None:
    """Map and validate one checkpoint key against the destinations; None means ignore it."""
    target = map_checkpoint_key(key if quant is None else quant.rename(key))
    if target is None:
        return None
    if target.name not in params:
        if key == LM_HEAD and EMBED in params and shape == tuple(params[EMBED].shape):
            return None  # tied embeddings: the caller passes no lm_head (see module docstring)
        raise CheckpointError(f"unexpected tensor {key!r} {list(shape)} in checkpoint: "
                              f"no destination {target.name!r}")
    dest = params[target.name]
    if target.expert is not None:
        if not _is_fused_experts(target.name, dest):
            raise CheckpointError(f"per-expert tensor {key!r} needs a fused [E, ...] destination; "
                                  f"{target.name!r} has shape {list(dest.shape)}")
        if target.expert >= dest.shape[0]:
            raise CheckpointError(f"unexpected tensor {key!r}: expert {target.expert} out of range, "
                                  f"{target.name!r} holds {dest.shape[0]} experts")
    expected = tuple(_destination_view(dest, target).shape)
    if shape != expected and not (quant and quant.broadcasts(target.name, shape, expected)):
        raise CheckpointError(f"tensor {key!r} has shape {list(shape)} in the checkpoint, "
                              f"expected {list(expected)} (destination {target.name!r})")
    return target


def _mtp_layers(keys, params: dict[str, torch.Tensor], declared: int = 0) -> set[str]:
    """Layer prefixes (`model.layers.{k}.`) of multi-token-prediction layers past the decoder: all of them once one
    holds an `eh_proj` (a module of several layers - MiniMax's `mtp_transformer_layers` - marks only its first),
    and the `declared` ones right after the decoder (`declared_mtp_layers`), as vLLM and SGLang skip them."""
    keys = set(keys)
    num_layers = 1 + max((int(m[1]) for m in map(_LAYER.match, params) if m), default=-1)
    past = {m[0] for m in map(_LAYER.match, keys) if m and int(m[1]) >= num_layers}
    if any(f"{prefix}{_MTP_MARK}" in keys for prefix in past):
        return past
    return {prefix for prefix in past if int(_LAYER.match(prefix)[1]) < num_layers + declared}


def declared_mtp_layers(model_dir: Path) -> int:
    """The multi-token-prediction layers config.json says follow the decoder: DeepSeek-V3's / GLM-4.5's
    `num_nextn_predict_layers`, MiniMax-M2's `num_mtp_modules` x `mtp_transformer_layers` (0: none, or no file)."""
    file = Path(model_dir) / "config.json"
    cfg = json.loads(file.read_text()) if file.is_file() else {}
    if cfg.get("num_nextn_predict_layers"):
        return int(cfg["num_nextn_predict_layers"])
    return int(cfg.get("num_mtp_modules") or 0) * int(cfg.get("mtp_transformer_layers") or 1)


def _plan(headers, params: dict[str, torch.Tensor], quant: FP8Loading | None = None,
          dtypes: dict[str, str] | None = None, mtp_layers: int = 0) -> dict[Path, list[tuple[str, KeyTarget, str]]]:
    """Per file, the (key, target, "copy" | "quantize") copies to make; raises on any unknown, duplicate,
    mis-shaped or missing tensor (and, FP8, a dtype that does not fit) before a byte of tensor data is read."""
    written: dict[str, set] = {name: set() for name in params}
    plan: dict[Path, list[tuple[str, KeyTarget, str]]] = {}
    mtp = _mtp_layers((k for s in headers.values() for k in s), params, mtp_layers)
    for path, shapes in headers.items():
        copies = plan.setdefault(path, [])
        for key, shape in shapes.items():
            layer = _LAYER.match(key)
            if layer and layer[0] in mtp:
                continue
            target = _target_of(key, shape, params, quant)
            if target is None:
                continue
            mode = "copy" if quant is None else quant.mode(key, dtypes[key], target.name, params[target.name])
            marks = [target] + ([target._replace(name=scale_name(target.name))] if mode == "quantize" else [])
            for t in marks:
                units = _units(t.name, params[t.name], t)
                if units & written[t.name]:
                    raise CheckpointError(f"tensor {key!r} writes part of {t.name!r} that another "
                                          f"checkpoint tensor already wrote (duplicate or mixed forms)")
                written[t.name] |= units
            copies.append((key, target, mode))
    _check_complete(params, written, _checkpoint_style(k for s in headers.values() for k in s),
                    quant.spell if quant else str)
    return plan


def _check_complete(params: dict[str, torch.Tensor], written: dict[str, set], style: str, spell=str) -> None:
    missing: list[str] = []
    for name, dest in params.items():
        all_units = _units(name, dest, KeyTarget(name))
        lacking = all_units - written[name]
        if not lacking:
            continue
        if lacking == {None} or (lacking == all_units and style == "fused"):
            missing.append(checkpoint_key(KeyTarget(name), style))
            continue
        per_expert_style = "hub" if style == "fused" else style
        missing += [checkpoint_key(KeyTarget(name, e, h), per_expert_style)
                    for e, h in sorted(lacking, key=lambda unit: (unit[0], unit[1] or 0))]
    missing = [spell(k) for k in missing]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s): "
                              f"{missing[:_SHOW_MISSING]}{' ...' if len(missing) > _SHOW_MISSING else ''}")


def load_checkpoint(model_dir, params: dict[str, torch.Tensor], *, progress: bool = True,
                    quant: FP8Loading | None = None) -> None:
    """Copy every tensor of the safetensors checkpoint in `model_dir` into `params` (moelora name ->
    preallocated destination, any dtype/device), casting dtype, one tensor at a time; `quant`: the
    model's FP8 rules (see the module docstring).

    Raises `CheckpointError` on a missing, unexpected, duplicated or mis-shaped tensor (before
    any data is copied), on a missing shard, and on a directory without safetensors weights.
    """
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    headers = _read_headers(_shard_files(Path(model_dir)), dtypes)
    plan = _plan(headers, params, quant, dtypes, declared_mtp_layers(Path(model_dir)))
    total = sum(len(copies) for copies in plan.values())
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar, \
            torch.no_grad():
        for path, copies in plan.items():
            with safe_open(str(path), framework="pt") as f:
                for key, target, mode in copies:
                    dest = _destination_view(params[target.name], target)
                    if mode == "quantize":
                        scale = _destination_view(params[scale_name(target.name)], target)
                        quant.quantize(f.get_tensor(key), dest, scale, _row_segments(target, dest))
                    elif quant is not None:
                        quant.copy(f.get_tensor(key), dest)
                    else:
                        dest.copy_(f.get_tensor(key))
                    bar.update(1)


_ONES = re.compile(r"(norm\.weight|scale|scale_inv)$")


def init_dummy_weights(params: dict[str, torch.Tensor], seed: int = 0, scale: float = 1e-3) -> None:
    """`--load-format dummy`: random weights instead of a checkpoint (a serving benchmark of a model that is
    not on disk). Matrices and embeddings draw U(-scale, scale) (vLLM's dummy range: activations stay small
    and every output finite); norm weights and quantization scales are 1, biases 0. Drawn on each
    destination's device from `seed`, one tensor at a time (no host copy of the model)."""
    with torch.no_grad():
        for i, (name, dest) in enumerate(params.items()):
            if _ONES.search(name):
                dest.fill_(1)
            elif name.endswith("bias") or dest.dim() < 2:
                dest.zero_()
            else:
                gen = torch.Generator(dest.device).manual_seed(seed + i)
                if dest.is_floating_point() and dest.element_size() >= 2:
                    dest.uniform_(-scale, scale, generator=gen)
                else:  # fp8 / integer storage: drawn in fp16, cast
                    draw = torch.empty(dest.shape, dtype=torch.float16, device=dest.device)
                    dest.copy_(draw.uniform_(-scale, scale, generator=gen))


def _row_segments(target: KeyTarget, dest: torch.Tensor) -> tuple[int, ...]:
    """A whole fused gate_up [E, 2I, H] is blocked per half; every other destination as one segment."""
    rows = dest.shape[-2]
    return (rows // 2, rows // 2) if target.name.endswith(GATE_UP) and target.half is None else (rows,)
