"""Argument types and the checks `moelora` runs on its flags before it loads anything.

A bad value ends the command the argparse way (usage, then one `moelora <cmd>: error: ...` line,
exit status 2) before a model is read: types check single values as they are parsed, `check_args`
checks what needs several flags or the file system.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
TRUE = ("1", "true")  # vLLM's reading of a boolean environment variable (case-insensitive)


def device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N or auto)")
    return text


_DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
           "bfloat16": "bfloat16"}


def dtype(text: str) -> str:
    """vLLM's --dtype spellings (half = float16, float = float32)."""
    if text not in _DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[text]


def port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:  # 0: a free port the system picks
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0..65535)")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def non_negative(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1]")
    return value


def lora_pair(text: str) -> tuple[str, str]:
    """`--lora NAME=PATH`."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def json_strings(text: str) -> list[str]:
    """A JSON list of strings (vLLM's --allowed-origins and its siblings)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as \'["*"]\', got {text!r}')
    return value


def json_object(text: str) -> dict:
    """A JSON-object argument (vLLM's config flags)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": 1}}', got {text!r}")
    return value


def compilation_config(text: str) -> dict:
    """vLLM's --compilation-config / -O: an optimization level (-O3) or a JSON object."""
    if re.fullmatch(r"[0-3]", text):
        return {"level": int(text)}
    return json_object(text)


# vLLM's JSON-object flags, which its parser also takes key by key: `--speculative-config.method mtp`
CONFIG_FLAGS = ("--speculative-config", "--compilation-config", "--structured-outputs-config", "--eplb-config",
                "--hf-overrides")


def hf_overrides(args) -> dict | None:
    """EngineConfig.hf_overrides from --hf-overrides and --rope-scaling (its `rope_scaling` field), None: none."""
    out = dict(args.hf_overrides or {})
    if args.rope_scaling is not None:
        out["rope_scaling"] = args.rope_scaling
    return out or None


def merge_dotted(argv: list[str], flags: tuple[str, ...] = CONFIG_FLAGS) -> list[str]:
    """`argv` with vLLM's dotted forms of JSON-object flags (`--F.a.b VALUE`, `--F.a.b=VALUE`; VALUE read as JSON
    where it parses, else a string) merged into one `--F JSON`, over an `--F JSON` given whole; as vLLM's
    FlexibleArgumentParser reads them."""
    import json

    out, merged, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        flag = next((f for f in flags if arg.startswith(f + ".")), None)
        if flag is None:
            out.append(arg)
            i += 1
            continue
        key, eq, value = arg[len(flag) + 1:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                out.append(arg)  # argparse names the flag it cannot read
                break
            value, i = argv[i + 1], i + 1
        i += 1
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass  # a bare word: a string (`--speculative-config.method mtp`)
        node = merged.setdefault(flag, {})
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    for flag, fields in merged.items():
        whole = {}
        for j, arg in enumerate(out):  # the last object given whole, `--F JSON` or `--F=JSON`
            text = out[j + 1] if arg == flag and j + 1 < len(out) else arg.partition("=")[2] if (
                arg.startswith(flag + "=")) else None
            if text is not None:
                try:
                    whole = json.loads(text)
                except json.JSONDecodeError:
                    whole = {}
        out += [flag, json.dumps({**(whole if isinstance(whole, dict) else {}), **fields})]
    return out


STRUCTURED_BACKENDS = ("auto", "xgrammar")  # vLLM's names of the backend served here (engine/structured.py)


def structured_outputs_config(text: str) -> dict:
    """vLLM's --structured-outputs-config JSON: backend (auto / xgrammar), disable_any_whitespace, enable_in_reasoning,
    reasoning_parser; disable_fallback and disable_additional_properties (guidance's) change nothing here."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"backend\": \"xgrammar\"}}', "
                                         f"got {text!r}")
    bools = ("disable_any_whitespace", "enable_in_reasoning", "disable_fallback", "disable_additional_properties")
    unknown = sorted(set(value) - {"backend", "reasoning_parser", *bools})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown structured outputs setting(s) {unknown}")
    if value.get("backend", "auto") not in STRUCTURED_BACKENDS:
        raise argparse.ArgumentTypeError(f"backend {value['backend']!r}: moelora serves structured outputs with "
                                         f"xgrammar (one of {STRUCTURED_BACKENDS})")
    if not all(isinstance(value.get(k, False), bool) for k in bools):
        raise argparse.ArgumentTypeError(f"{', '.join(bools)} are true or false")
    return value


def structured_backend(text: str) -> str:
    """vLLM < 0.10's --guided-decoding-backend: the one backend served here, or "auto"."""
    if text not in STRUCTURED_BACKENDS:
        raise argparse.ArgumentTypeError(f"{text!r}: moelora serves structured outputs with xgrammar (one of "
                                         f"{STRUCTURED_BACKENDS})")
    return text


def env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in TRUE


def api_keys(flag: list[str] | None) -> tuple[str, ...]:
    """`--api-key` values, else MOELORA_API_KEY, else VLLM_API_KEY (vLLM's variable)."""
    if flag:
        return tuple(flag)
    for var in ("MOELORA_API_KEY", "VLLM_API_KEY"):
        if os.environ.get(var):
            return (os.environ[var],)
    return ()


def _model_dir_error(model: str | None, load_format: str) -> str | None:
    if model is None:
        return None
    path = Path(model)
    if not (path / "config.json").is_file():
        return f"model {model!r}: no config.json there (a local model directory is needed)"
    if load_format != "dummy" and not any(path.glob("*.safetensors")):
        return f"model {model!r}: no *.safetensors weights there (--load-format dummy serves random weights)"
    return None


def check_args(parser: argparse.ArgumentParser, args, adapters: dict[str, str]) -> None:
    """What the parser cannot check value by value; `parser.error` (exit 2) on the first problem."""
    problems = []
    if getattr(args, "command", None) == "verify" and getattr(args, "quantization", None):
        problems.append("moelora verify compares a checkpoint as it is stored (an FP8 one against transformers + "
                        "PEFT on its dequantized weights); --quantization does not apply")
    if getattr(args, "command", None) == "verify" and (getattr(args, "hf_overrides", None)
                                                       or getattr(args, "rope_scaling", None)):
        problems.append("moelora verify compares a checkpoint as it is stored; --hf-overrides / --rope-scaling do not "
                        "apply (edit config.json to verify another configuration)")
    if getattr(args, "max_loras", 1) == 0 and adapters:
        problems.append("--max-loras 0 leaves no adapter slot, but adapters are given: "
                        + ", ".join(repr(n) for n in sorted(adapters)))
    problems.append(_model_dir_error(getattr(args, "model", None), getattr(args, "load_format", "auto")))
    for name, path in adapters.items():
        if not Path(path).exists():
            problems.append(f"adapter {name!r}: {path!r} does not exist")
    if getattr(args, "command", None) == "serve":
        problems += _serve_problems(args)
    problems = [p for p in problems if p]
    if problems:
        parser.error(problems[0])


def check_node_args(parser: argparse.ArgumentParser, args) -> None:
    """`serve`'s several-host flags (vLLM's rule: a node other than 0 runs --headless)."""
    if args.node_rank >= args.nnodes:
        parser.error(f"--node-rank {args.node_rank} is not one of the --nnodes {args.nnodes} nodes "
                     f"(0..{args.nnodes - 1})")
    if args.node_rank > 0 and not args.headless:
        parser.error(f"--node-rank {args.node_rank}: a node other than 0 runs --headless (node 0 runs the server)")
    if args.headless and args.node_rank == 0:
        parser.error("--headless is for nodes 1..N-1; node 0 runs the server (drop --headless)")
    if args.nnodes > 1 and not args.headless and args.tensor_parallel_size % args.nnodes:
        parser.error(f"--nnodes {args.nnodes} must divide --tensor-parallel-size {args.tensor_parallel_size}")


def _serve_problems(args) -> list[str | None]:
    from moelora.engine.tokenizer import has_tokenizer, resolve_chat_template
    from moelora.errors import ConfigError
    from moelora.server.reasoning import REASONING_PARSERS

    out: list[str | None] = []
    try:
        resolve_chat_template(args.chat_template)
    except ConfigError as e:
        out.append(str(e))
    from moelora.vllm_flags import check

    out += check(args)
    if args.tokenizer is not None and not has_tokenizer(args.tokenizer):
        out.append(f"--tokenizer {args.tokenizer!r}: no tokenizer.json (nor tiktoken.model) there")
    if args.generation_config not in ("auto", "vllm") and not Path(args.generation_config).is_dir():
        out.append(f"--generation-config {args.generation_config!r}: not 'auto', 'vllm' or a directory")
    out += [f"--lora-root {r!r} is not a directory" for r in args.lora_root or () if not Path(r).is_dir()]
    if args.max_model_len is not None and args.max_model_len < 2:
        out.append("--max-model-len must be >= 2 (a prompt token and a generated one)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        out.append("--enable-auto-tool-choice needs --tool-call-parser (the model family's format of a call)")
    so_parser = (args.structured_outputs_config or {}).get("reasoning_parser")
    if so_parser is not None and so_parser not in REASONING_PARSERS:
        out.append(f"--structured-outputs-config reasoning_parser {so_parser!r}: one of {sorted(REASONING_PARSERS)}")
    if so_parser and args.reasoning_parser not in (None, so_parser):
        out.append(f"--structured-outputs-config reasoning_parser {so_parser!r} and --reasoning-parser "
                   f"{args.reasoning_parser!r} differ: give one")
    if args.enable_reasoning and args.reasoning_parser is None and not so_parser:
        out.append("--enable-reasoning needs --reasoning-parser (the model family's reasoning tags)")
    if args.pipeline_parallel_size != 1:
        out.append(f"--pipeline-parallel-size {args.pipeline_parallel_size}: pipeline parallelism is not "
                   "implemented; split the model with --tensor-parallel-size (and --enable-expert-parallel)")
    if args.data_parallel_size != 1:
        out.append(f"--data-parallel-size {args.data_parallel_size}: one engine a server; run one server per "
                   "replica behind a load balancer")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        out.append("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    out += [f"{flag} {path!r} does not exist" for flag, path in (("--ssl-keyfile", args.ssl_keyfile),
            ("--ssl-certfile", args.ssl_certfile), ("--ssl-ca-certs", args.ssl_ca_certs))
            if path is not None and not Path(path).is_file()]
    return out
