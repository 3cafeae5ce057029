"""`FP8Config`: the FP8 scheme of a checkpoint (config.json's `quantization_config`) or of `--quantization fp8`.

Accepted (anything else is a `ConfigError` naming the field and value):
- `quant_method: "fp8"` (DeepSeek-V3/R1, the official Qwen3 / GLM `-FP8` checkpoints): `fmt: "e4m3"`,
  `activation_scheme: "dynamic"`, `weight_block_size: [128, 128]`, optional `scale_fmt: "ue8m0"` (the
  scales are still fp32 tensors, powers of two), `modules_to_not_convert` / `ignored_layers`. Weights
  `float8_e4m3fn`, `weight_scale_inv` [ceil(out/128), ceil(in/128)]. Activations: dynamic 1 x 128 groups.
- `quant_method: "compressed-tensors"`, `format: "float-quantized"` (llm-compressor's FP8 / FP8_DYNAMIC):
  one scheme over `targets: ["Linear"]` (several config groups only if they are identical), weights
  `num_bits: 8, type: "float", symmetric`, `strategy: "channel"` (`weight_scale` [out, 1]), `"tensor"`
  ([1] or a scalar) or `"block"` with `block_structure: [128, 128]` (FP8_BLOCK: `weight_scale`
  [ceil(out/128), ceil(in/128)]); `input_activations` null or `dynamic: true` with `strategy: "token"` or
  `"group"` of `group_size: 128`; `ignore` list (names or `re:` patterns). No kv-cache or
  output-activation scheme.
`from_engine("fp8")` is `--quantization fp8` on a bf16/fp16/fp32 checkpoint: the "fp8" block scheme,
applied while loading. Routers, norms, embeddings and the LM head are never quantized (the layers
build them without `quant`); a checkpoint whose ignore list names a projection moelora holds in FP8 is
refused (`quant.storage.check_ignored`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from moelora.errors import ConfigError

WEIGHT_SCHEMES = ("block", "channel", "tensor")
ACTIVATION_SCHEMES = ("group", "token", "none")
_CT_WEIGHT_FIELDS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


@dataclass(frozen=True)
class FP8Config:
    """method: "fp8" or "compressed-tensors" (the checkpoint's; "fp8" for quantize-on-load too).
    weights: "block" (128 x 128 scales), "channel" (per output row) or "tensor" (stored per row).
    activations: the dynamic activation scheme a W8A8 GEMM applies: "group" (1 x 128 per token),
    "token" (per token) or "none" (weight-only). ignore: modules the checkpoint left unquantized.
    on_load: quantize a high-precision checkpoint while loading. quantize_activations: the W8A8 twin
    (`EngineConfig.fp8_activation_quant`); off, the GEMMs read the activations as they are (W8A16)."""

    method: str
    weights: str
    activations: str
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()
    on_load: bool = False
    quantize_activations: bool = False

    @property
    def scale_key(self) -> str:
        """The checkpoint's name of a weight's scale (`X.<scale_key>` next to `X.weight`)."""
        return "weight_scale" if self.method == "compressed-tensors" else "weight_scale_inv"

    @property
    def activation_group(self) -> int | None:
        """Columns per activation scale: 128 ("group"), None for the whole row ("token")."""
        return self.block[1] if self.activations == "group" else None

    def ignores(self, module: str) -> bool:
        """Whether `module` (a full name) is in the checkpoint's unquantized list."""
        return any(_matches(p, module) for p in self.ignore)

    @staticmethod
    def from_engine(quantization: str) -> FP8Config:
        if quantization != "fp8":
            raise ConfigError(f"quantization={quantization!r} is not supported (only 'fp8')")
        return FP8Config("fp8", "block", "group", (128, 128), on_load=True)


def _matches(pattern: str, module: str) -> bool:
    """transformers' `modules_to_not_convert` rule (a prefix or regex ending at a module boundary, or a
    suffix) and compressed-tensors' (`re:` + a regex from the start, else the name or a suffix)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if module == pattern or module.endswith("." + pattern):
        return True
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) is not None
    except re.error:  # not a regex: a plain name, matched above
        return False


def parse_quantization_config(raw: Any) -> FP8Config | None:
    """config.json's `quantization_config` -> FP8Config (None when absent)."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "fp8":
        return _parse_fp8(raw)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    raise ConfigError(f"unsupported quantization_config quant_method={method!r}: moelora loads FP8 checkpoints "
                      f"('fp8' with 128 x 128 blocks, 'compressed-tensors' float-quantized) and bf16/fp16/fp32")


def _parse_fp8(raw: dict) -> FP8Config:
    fmt = raw.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # DeepSeek's / Qwen's spelling, MiniMax-M2's (the torch dtype's name)
        raise ConfigError(f"unsupported quantization_config fmt={fmt!r} (only 'e4m3', also spelled "
                          "'float8_e4m3fn')")
    act = raw.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(f"unsupported quantization_config activation_scheme={act!r} (only 'dynamic': static "
                          f"activation scales are not supported)")
    block = raw.get("weight_block_size")
    if block is None or list(block) != [128, 128]:
        raise ConfigError(f"unsupported quantization_config (quant_method 'fp8') weight_block_size={block!r} "
                          f"(only [128, 128])")
    scale_fmt = raw.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise ConfigError(f"unsupported quantization_config scale_fmt={scale_fmt!r}")
    ignore = tuple(raw.get("modules_to_not_convert") or ()) + tuple(raw.get("ignored_layers") or ())
    return FP8Config("fp8", "block", "group", (128, 128), ignore=ignore)


def _parse_compressed_tensors(raw: dict) -> FP8Config:
    fmt = raw.get("format")
    if fmt != "float-quantized":
        raise ConfigError(f"unsupported compressed-tensors format={fmt!r} (only 'float-quantized' FP8)")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if raw.get(field):
            raise ConfigError(f"unsupported compressed-tensors {field}={raw[field]!r}")
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise ConfigError(f"unsupported compressed-tensors quantization_status={status!r} (only 'compressed')")
    groups = list((raw.get("config_groups") or {}).values())
    if not groups:
        raise ConfigError("compressed-tensors quantization_config has no config_groups")
    schemes = {_group_scheme(g) for g in groups}
    if len(schemes) > 1:
        raise ConfigError(f"compressed-tensors config_groups with different schemes are not supported: "
                          f"{sorted(schemes)}")
    weights, activations = schemes.pop()
    return FP8Config("compressed-tensors", weights, activations, (128, 128), ignore=tuple(raw.get("ignore") or ()))


def _group_scheme(group: dict) -> tuple[str, str]:
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise ConfigError(f"unsupported compressed-tensors targets={targets!r} (only ['Linear'])")
    if group.get("output_activations"):
        raise ConfigError("unsupported compressed-tensors output_activations (only null)")
    w = group.get("weights") or {}
    for field, want in _CT_WEIGHT_FIELDS.items():
        if w.get(field, want) != want:
            raise ConfigError(f"unsupported compressed-tensors weights {field}={w.get(field)!r} (only {want!r}: "
                              f"8-bit float, symmetric, static weights)")
    strategy = w.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        raise ConfigError(f"unsupported compressed-tensors weights strategy={strategy!r} (only 'channel', 'tensor', "
                          f"'block')")
    if strategy == "block" and list(w.get("block_structure") or ()) != [128, 128]:
        raise ConfigError(f"unsupported compressed-tensors weights block_structure={w.get('block_structure')!r} "
                          f"(only [128, 128])")
    a = group.get("input_activations")
    if not a:
        return strategy, "none"
    if not a.get("dynamic"):
        raise ConfigError("unsupported compressed-tensors input_activations dynamic=false: static activation "
                          "scales are not supported")
    kind = {"token": "token", "group": "group"}.get(a.get("strategy"))
    if (a.get("num_bits", 8) != 8 or a.get("type", "float") != "float" or kind is None
            or (kind == "group" and a.get("group_size") != 128)):
        raise ConfigError(f"unsupported compressed-tensors input_activations num_bits={a.get('num_bits')!r} "
                          f"type={a.get('type')!r} strategy={a.get('strategy')!r} group_size={a.get('group_size')!r} "
                          f"(only 8-bit float per 'token', or per 'group' of 128)")
    return strategy, kind
