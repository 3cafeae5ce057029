"""FP8 checkpoint rules the strict loader (`models.weights`) applies, and the dequantized copy `verify` reads.

Shape legend: N output rows, K input columns, E experts, I expert intermediate, H hidden.

On disk, next to each FP8 `X.weight` (float8_e4m3fn): `X.weight_scale_inv` (quant_method "fp8": fp32 or
bf16 [ceil(N/128), ceil(K/128)]) or `X.weight_scale` (compressed-tensors: [N, 1] per channel, [1] or a
scalar per tensor). Expert keys are per expert (`mlp.experts.{e}.gate_proj.weight_scale_inv`, ...) or
fused as transformers' FP8 experts hold them (`mlp.experts.gate_up_proj_scale_inv` [E, 2 ceil(I/128),
ceil(H/128)], the gate and up halves blocked each on its own -- transformers' grid whenever I is a
multiple of 128, as in every shipped checkpoint --, `mlp.experts.down_proj_scale_inv`). moelora's
destinations are named `X.weight_scale_inv` / `experts.{gate_up,down}_proj_scale_inv` whatever the
checkpoint calls them; error messages use the checkpoint's spelling.

Strict (contract 7): a missing or mis-shaped scale, an FP8 tensor where moelora holds high precision (a
router, norm, embedding, LM head) and a high-precision tensor where it holds FP8 are `CheckpointError`s
naming the key, both shapes or both dtypes. With `FP8Config.on_load` (`--quantization fp8` on a
bf16/fp16/fp32 checkpoint) every FP8 destination is quantized from its high-precision tensor instead
(128 x 128 blocks, per expert and per half), and its scale is written with it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from moelora.errors import CheckpointError
from moelora.quant.config import FP8Config
from moelora.quant.fp8 import FP8_DTYPE, quantize_segments
from moelora.quant.storage import dense_weight

SCALE = "_scale_inv"  # destination suffix: X.weight -> X.weight_scale_inv, experts.down_proj -> down_proj_scale_inv
FP8_ON_DISK = "F8_E4M3"
HIGH_PRECISION_ON_DISK = ("BF16", "F16", "F32")


def scale_name(weight_name: str) -> str:
    """The scale destination of an FP8 weight destination."""
    return weight_name + SCALE


def is_scale(name: str) -> bool:
    return name.endswith(SCALE)


@dataclass(frozen=True)
class FP8Loading:
    """What `load_checkpoint` does differently for an FP8 model (`cfg` the model's scheme)."""

    cfg: FP8Config

    def rename(self, key: str) -> str:
        """A checkpoint key in moelora's spelling (compressed-tensors' `weight_scale` -> `weight_scale_inv`)."""
        if self.cfg.scale_key == "weight_scale" and key.endswith(".weight_scale"):
            return key + "_inv"
        return key

    def spell(self, key: str) -> str:
        """Inverse of `rename`, for messages."""
        if self.cfg.scale_key == "weight_scale" and key.endswith(".weight_scale_inv"):
            return key[: -len("_inv")]
        return key

    def broadcasts(self, name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
        """A per-tensor scale ([1] or a scalar) fills its weight's per-row scale [.., N, 1]."""
        return self.cfg.weights == "tensor" and is_scale(name) and shape in ((), (1,)) and expected[-1:] == (1,)

    def mode(self, key: str, disk_dtype: str, name: str, dest: torch.Tensor) -> str:
        """"copy" or "quantize" (an FP8 destination from a high-precision tensor, quantize-on-load)."""
        src_fp8, dest_fp8 = disk_dtype == FP8_ON_DISK, dest.dtype == FP8_DTYPE
        if dest_fp8 and not src_fp8:
            if self.cfg.on_load and disk_dtype in HIGH_PRECISION_ON_DISK:
                return "quantize"
            raise CheckpointError(f"tensor {key!r} is {disk_dtype} in the checkpoint, but moelora holds {name!r} in "
                                  f"float8_e4m3fn (quantization_config quant_method={self.cfg.method!r})")
        if src_fp8 and not dest_fp8:
            raise CheckpointError(f"tensor {key!r} is float8_e4m3fn in the checkpoint, but moelora holds {name!r} in "
                                  f"{str(dest.dtype).removeprefix('torch.')} (routers, norms, embeddings and the LM "
                                  f"head are not quantized)")
        return "copy"

    @staticmethod
    def copy(src: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy a checkpoint tensor into its destination view; a per-tensor scale is broadcast over the rows."""
        dest.copy_(src.reshape(1) if src.dim() == 0 else src)

    def quantize(self, src: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, segments: tuple[int, ...]
                 ) -> None:
        """Quantize-on-load: block-quantize `src` [.., N, K] per row segment into `weight` and `scale` views."""
        q, s = quantize_segments(src.to(weight.device), segments, self.cfg.block)
        weight.copy_(q)
        scale.copy_(s)


def dequantize_checkpoint(src_dir: str | Path, dst_dir: str | Path, cfg: FP8Config) -> None:
    """Write the FP8 checkpoint in `src_dir` to `dst_dir` as fp32 (one model.safetensors; config.json without
    quantization_config; tokenizer files copied), each FP8 weight dequantized with its scale -- what
    `moelora verify` hands transformers + PEFT. The gate_up fused form is dequantized per half."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if key.endswith((".weight_scale", ".weight_scale_inv", SCALE)):
            continue
        if t.dtype != FP8_DTYPE:
            out[key] = t.float()
            continue
        base = key[: -len("weight")] + cfg.scale_key if key.endswith(".weight") else key + SCALE
        if base not in tensors:
            raise CheckpointError(f"checkpoint lacks {base!r}, the scale of FP8 tensor {key!r} {list(t.shape)}")
        rows = t.shape[-2]
        segments = (rows // 2, rows // 2) if key.endswith("experts.gate_up_proj") else (rows,)
        out[key] = dense_weight(t, tensors[base].reshape(-1, 1) if tensors[base].dim() < 2 else tensors[base],
                                cfg, segments, torch.float32).contiguous()
    save_file(out, str(dst_dir / "model.safetensors"))
    config = json.loads((src_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "float32"
    (dst_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (src_dir / name).is_file():
            shutil.copy(src_dir / name, dst_dir / name)
