"""FP8 checkpoints of the tiny oracle models, written by the tests themselves (no moelora code).

`write_fp8_checkpoint(hf, dir, scheme, form)` quantizes every projection of a randomised transformers
model the way the shipped checkpoints are quantized -- "block": DeepSeek/Qwen/GLM `quant_method: fp8`,
128 x 128 blocks with `weight_scale_inv`; "channel" / "tensor": llm-compressor's compressed-tensors
FP8 with `weight_scale` -- in per-expert or fused expert form, and loads the hand-dequantized weights
back into `hf`, so that transformers + PEFT then run exactly the weights the checkpoint holds. The
quantization loops over blocks one by one: an implementation independent of `moelora.quant`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
B = 128
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
             "gate_proj", "up_proj", "down_proj")


def quantize_loop(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q e4m3, scale, w_dequantized fp32), one block / row / tensor at a time."""
    w = w.float()
    n, k = w.shape
    q, deq = torch.empty(n, k, dtype=FP8), torch.empty(n, k)
    if scheme == "block":
        scale = torch.empty(math.ceil(n / B), math.ceil(k / B))
        groups = [(i, j, slice(i * B, (i + 1) * B), slice(j * B, (j + 1) * B))
                  for i in range(scale.shape[0]) for j in range(scale.shape[1])]
    elif scheme == "channel":
        scale = torch.empty(n, 1)
        groups = [(r, 0, slice(r, r + 1), slice(0, k)) for r in range(n)]
    else:
        scale = torch.empty(1)
        groups = [(0, None, slice(0, n), slice(0, k))]
    for i, j, rows, cols in groups:
        block = w[rows, cols]
        amax = block.abs().max().item()
        s = amax / 448.0 if amax > 0 else 1.0
        q[rows, cols] = (block / s).clamp(-448, 448).to(FP8)
        deq[rows, cols] = q[rows, cols].float() * s
        if j is None:
            scale[0] = s
        else:
            scale[i, j] = s
    return q, scale, deq


def _is_projection(key: str) -> bool:
    return key.endswith(".weight") and key.rsplit(".", 2)[-2] in QUANTIZED


def write_fp8_checkpoint(hf, out_dir, scheme: str, form: str = "per_expert", shards: int = 1) -> Path:
    """Write `hf` as an FP8 checkpoint in `out_dir` and set `hf`'s projections to their dequantized values."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    scale_key = "weight_scale_inv" if scheme == "block" else "weight_scale"
    blocks = scheme in ("block", "ct_block")
    tensors: dict[str, torch.Tensor] = {}
    deq_state: dict[str, torch.Tensor] = {}

    def put(key: str, w: torch.Tensor) -> torch.Tensor:
        q, s, deq = quantize_loop(w, "block" if blocks else scheme)
        tensors[key], tensors[key[: -len("weight")] + scale_key] = q, s
        return deq

    for key, w in hf.state_dict().items():
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            deq_state[key] = _experts(key, w, form, put, tensors)
        elif _is_projection(key):
            deq_state[key] = put(key, w)
        else:
            tensors[key] = w.contiguous()
    _save(tensors, out_dir, shards)
    config = hf.config.to_dict()
    config["architectures"] = [type(hf).__name__]
    config["quantization_config"] = quantization_config(scheme)
    (out_dir / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        for key, w in deq_state.items():
            hf.get_parameter(key).copy_(w)
    return out_dir


def _experts(key: str, w: torch.Tensor, form: str, put, tensors) -> torch.Tensor:
    """Quantize fused experts [E, out, in] per expert (gate and up each on its own); write them per expert
    (Hub keys) or fused with `{name}_scale_inv` (transformers' FP8 experts)."""
    prefix, name = key.rsplit(".", 1)
    deq = torch.empty_like(w)
    halves = ("gate_proj", "up_proj") if name == "gate_up_proj" else ("down_proj",)
    rows = w.shape[1] // len(halves)
    fused_q, fused_s = [], []
    for e in range(w.shape[0]):
        qs, ss = [], []
        for h, proj in enumerate(halves):
            sub = f"{prefix}.{e}.{proj}.weight"
            deq[e, h * rows:(h + 1) * rows] = put(sub, w[e, h * rows:(h + 1) * rows])
            qs.append(tensors.pop(sub) if form == "fused" else tensors[sub])
            ss.append(tensors.pop(sub[: -len("weight")] + "weight_scale_inv") if form == "fused" else None)
        fused_q.append(torch.cat(qs))
        fused_s.append(torch.cat(ss) if form == "fused" else None)
    if form == "fused":
        tensors[key], tensors[key + "_scale_inv"] = torch.stack(fused_q), torch.stack(fused_s)
    return deq


def _save(tensors: dict[str, torch.Tensor], out_dir: Path, shards: int) -> None:
    keys = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: tensors[k] for k in part}, str(out_dir / name))
        weight_map.update(dict.fromkeys(part, name))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def quantization_config(scheme: str) -> dict:
    """"block": quant_method fp8; "channel" / "tensor" / "ct_block": compressed-tensors FP8_DYNAMIC / FP8_BLOCK."""
    if scheme == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}
    group = {"targets": ["Linear"], "output_activations": None,
             "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": scheme,
                         "group_size": None, "observer": "minmax"},
             "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                   "strategy": "token", "observer": None}}
    if scheme == "ct_block":
        group["weights"].update(strategy="block", block_structure=[128, 128])
        group["input_activations"].update(strategy="group", group_size=128)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "kv_cache_scheme": None,
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]}
