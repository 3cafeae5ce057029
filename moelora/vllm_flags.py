"""vLLM `serve` flags for machinery moelora does not have, accepted so that vLLM launch lines run: each is either
given its meaning here (where moelora has the thing), noted at start-up as ignored (a performance or deployment
setting of vLLM's own machinery: outputs do not depend on it), or refused with the reason (a setting that would
change what is served). Also vLLM's `--config FILE`: a YAML file of flags, the command line over it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moelora import cli_args as types
from moelora.errors import ConfigError

LOGPROBS_MODES = ("raw_logprobs",)  # the model's own distribution, before temperature and penalties (vLLM's default)


def add_flags(serve: argparse.ArgumentParser) -> None:
    """The flags of this module on `moelora serve`'s parser."""
    serve.add_argument("--config", default=None, metavar="YAML",
                       help="vLLM's config file: a YAML mapping of flag names (dashes or underscores) to values; "
                            "flags on the command line take precedence")
    serve.add_argument("--override-generation-config", type=types.json_object, default=None, metavar="JSON",
                       help="sampling defaults over --generation-config's (auto: merged over generation_config.json; "
                            "vllm: these alone), e.g. '{\"temperature\": 0.6}'")
    serve.add_argument("--default-chat-template-kwargs", type=types.json_object, default=None, metavar="JSON",
                       help="chat template variables every chat request gets (e.g. '{\"enable_thinking\": false}'); "
                            "a request's chat_template_kwargs take precedence")
    serve.add_argument("--enable-server-load-tracking", action="store_true",
                       help="GET /load answers {\"server_load\": the generation requests in flight}")
    serve.add_argument("--max-log-len", type=types.non_negative, default=None, metavar="N",
                       help="--enable-log-requests: at most N characters of each request logged (default 4096)")
    serve.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs",
                       help="what logprobs report: raw_logprobs, the model's distribution before temperature and "
                            "penalties (the one mode served)")
    serve.add_argument("--lora-dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                       help="LoRA weights are held in the model's dtype (--dtype); another is refused")
    serve.add_argument("--cpu-offload-gb", type=float, default=0.0, metavar="GIB",
                       help="0 only: weights stay on the GPU")
    # vLLM's performance and deployment machinery: accepted, noted at start-up (`ignored_flags`)
    serve.add_argument("--speculative-config", type=types.json_object, default=None, metavar="JSON",
                       help="accepted for vLLM command lines (e.g. MTP: '{\"method\": \"mtp\"}' or "
                            "--speculative-config.method mtp): speculative decoding is not implemented (logged)")
    serve.add_argument("--compilation-config", "-O", type=types.compilation_config, default=None,
                       metavar="LEVEL|JSON", help="accepted for vLLM command lines (-O3, a JSON object): moelora "
                                                  "runs its own kernels and CUDA graphs (logged as ignored)")
    serve.add_argument("--cuda-graph-sizes", type=types.positive, nargs="+", default=None, metavar="N",
                       help="accepted: moelora captures its own sizes (decode graphs at 1, 2, 4, 8, then every 16 to "
                            "--max-num-seqs; prompt steps up to --max-cudagraph-capture-size tokens); logged")
    serve.add_argument("--enable-eplb", action="store_true",
                       help="accepted for vLLM command lines: expert load balancing is not implemented (logged)")
    serve.add_argument("--eplb-config", type=types.json_object, default=None, metavar="JSON",
                       help="accepted with --enable-eplb (logged as ignored)")
    serve.add_argument("--fully-sharded-loras", action="store_true",
                       help="accepted: adapters are split across ranks as docs/parallel.md says (logged)")
    serve.add_argument("--enable-sleep-mode", action="store_true",
                       help="accepted: sleep mode (/sleep, /wake_up) is not implemented (logged)")
    for flag in ("--max-num-partial-prefills", "--max-long-partial-prefills", "--long-prefill-token-threshold"):
        serve.add_argument(flag, type=types.non_negative, default=None, metavar="N",
                           help="accepted: prompts are chunked by --max-num-batched-tokens alone (logged)")
    serve.add_argument("--max-parallel-loading-workers", type=types.positive, default=None, metavar="N",
                       help="accepted: the checkpoint's files are read one after another (logged)")
    serve.add_argument("--calculate-kv-scales", action="store_true",
                       help="accepted: the KV cache holds the model's dtype, it has no scales (logged)")
    for flag, why in (("--disable-frontend-multiprocessing", "the API server and the engine share one process"),
                      ("--disable-sliding-window", "no family served here has sliding-window attention")):
        serve.add_argument(flag, action="store_true", help=f"accepted: {why}")
    serve.add_argument("--model-impl", choices=["auto", "vllm"], default="auto",
                       help="accepted: moelora's own model classes")
    serve.add_argument("--hf-token", default=None, metavar="TOKEN",
                       help="accepted: MODEL is a local directory, nothing is downloaded")


def ignored_flags(args) -> list[str]:
    """What the server logs at start-up for vLLM flags it accepts but has no use for."""
    out = []
    if args.speculative_config:
        out.append(f"--speculative-config {args.speculative_config}: speculative decoding is not implemented here; "
                   "every token is decoded by the model itself (the outputs a lossless speculation would give)")
    if args.compilation_config:
        out.append(f"--compilation-config {args.compilation_config}: moelora runs its own Triton kernels under its "
                   "own CUDA graphs (--max-cudagraph-capture-size, --enforce-eager); ignored")
    if args.cuda_graph_sizes:
        out.append(f"--cuda-graph-sizes {' '.join(map(str, args.cuda_graph_sizes))}: moelora captures decode "
                   "graphs at batch sizes 1, 2, 4, 8, then every 16 up to --max-num-seqs, and prompt steps up to "
                   "--max-cudagraph-capture-size tokens; ignored")
    if args.enable_eplb or args.eplb_config:
        out.append("--enable-eplb / --eplb-config: expert load balancing (replicating hot experts across EP ranks) is "
                   "not implemented; the experts stay where --enable-expert-parallel puts them")
    if args.fully_sharded_loras:
        out.append("--fully-sharded-loras: adapters follow their layers' split across ranks (docs/parallel.md); "
                   "ignored")
    if args.enable_sleep_mode:
        out.append("--enable-sleep-mode: sleep mode is not implemented (no /sleep or /wake_up); the weights and KV "
                   "cache stay on the GPU")
    partial = [f for f in ("max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold")
               if getattr(args, f) is not None]
    if partial:
        out.append(f"--{partial[0].replace('_', '-')}: concurrent partial prefills are not scheduled apart; prompts "
                   "are chunked by --max-num-batched-tokens alone")
    if args.max_parallel_loading_workers is not None:
        out.append("--max-parallel-loading-workers: the checkpoint's files are read one after another; ignored")
    if args.calculate_kv_scales:
        out.append("--calculate-kv-scales: the KV cache holds the model's dtype and has no scales; ignored")
    return out


def check(args) -> list[str]:
    """Refusals of this module's flags (settings that would change what is served)."""
    out = []
    if args.cpu_offload_gb:
        out.append(f"--cpu-offload-gb {args.cpu_offload_gb:g}: offloading weights to host memory is not implemented "
                   "(0 only)")
    if args.lora_dtype != "auto" and args.dtype not in ("auto", args.lora_dtype):
        out.append(f"--lora-dtype {args.lora_dtype}: LoRA weights are held in the model's dtype (--dtype "
                   f"{args.dtype}); use auto")
    return out


def expand_config_file(argv: list[str]) -> list[str]:
    """`argv` with `--config FILE`'s flags inserted after the subcommand, before the command line's own (so the
    command line's take precedence, as in vLLM): a mapping of flag names to values; `true` a bare flag, `false`
    none, a list its items, a mapping its JSON; `model` the positional MODEL when the command line names none."""
    spot = next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)
    if spot is None:
        return argv
    if argv[spot] == "--config":
        if spot + 1 >= len(argv):
            return argv  # argparse names the flag it cannot read
        file, rest = argv[spot + 1], argv[:spot] + argv[spot + 2:]
    else:
        file, rest = argv[spot].partition("=")[2], argv[:spot] + argv[spot + 1:]
    try:
        import yaml
    except ImportError:
        raise ConfigError("--config needs PyYAML (pip install pyyaml)") from None
    try:
        data = yaml.safe_load(Path(file).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {file!r}: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {file!r} must hold a mapping of flag names to values, got {type(data).__name__}")
    # after the subcommand and its MODEL if that comes first (a list-valued flag must not take MODEL as an item),
    # before the command line's own flags
    head, tail = rest[:1], rest[1:]
    if tail and not tail[0].startswith("-"):
        head, tail = rest[:2], rest[2:]
    flags, model = [], data.pop("model", None)
    for key, value in data.items():
        name, dot, sub = str(key).partition(".")  # a dotted key's sub-keys keep their own spelling
        flag = "--" + name.replace("_", "-") + dot + sub
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            flags += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    if model is not None and len(head) == 1:
        flags.insert(0, str(model))
    return head + flags + tail
