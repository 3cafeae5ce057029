"""Command line: `moelora generate | verify | demo | serve | bench`.

With no MODEL argument the bundled demo model is used, with its adapters registered by name.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from moelora import cli_args as types
from moelora import vllm_flags
from moelora.errors import MoeLoRAError
from moelora.server.reasoning import REASONING_PARSERS
from moelora.server.tools import TOOL_PARSERS

log = logging.getLogger("moelora.server")

if TYPE_CHECKING:
    from moelora.engine.config import EngineConfig


def _model_and_adapters(args) -> tuple[str, dict[str, str]]:
    adapters = dict(args.lora or ())
    if args.model:
        return args.model, adapters
    from moelora.demo import ADAPTER_NAMES, adapter_dir, model_dir

    return str(model_dir()), {**{name: str(adapter_dir(name)) for name in ADAPTER_NAMES}, **adapters}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="HF model directory (default: the bundled demo)")
    p.add_argument("--lora", action="append", type=types.lora_pair, metavar="NAME=PATH", help="register an adapter")
    p.add_argument("--device", type=types.device, default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", type=types.dtype, default="auto", help="auto, float32 (float), float16 (half), bfloat16")
    p.add_argument("--max-lora-rank", type=types.non_negative, default=64)
    p.add_argument("--max-loras", type=types.non_negative, default=8, help="device adapter slots")
    p.add_argument("--quantization", "-q", choices=["fp8", "compressed-tensors"], default=None,
                   help="fp8: quantize a bf16 checkpoint's projections to FP8 while loading (128x128 blocks); "
                        "default: as the checkpoint is (FP8 checkpoints load as FP8)")
    p.add_argument("--hf-overrides", type=types.json_object, default=None, metavar="JSON",
                   help="config.json fields replaced when the model is read (vLLM's), e.g. "
                        "'{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 32768}}'")
    p.add_argument("--rope-scaling", type=types.json_object, default=None, metavar="JSON",
                   help="vLLM's older spelling of --hf-overrides '{\"rope_scaling\": JSON}'")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine flags `serve` and `bench` share (vLLM's names)."""
    p.add_argument("--gpu-memory-utilization", type=types.fraction, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--max-cudagraph-capture-size", type=types.non_negative, default=2048,
                   help="the largest step with prompt rows replayed as piecewise CUDA graphs, in tokens (0: such "
                        "steps run eagerly; decode graphs cover up to --max-num-seqs sequences either way)")
    p.add_argument("--kernel-backend", choices=["triton", "torch"], default=None,
                   help="default: triton on CUDA, torch on the CPU")
    # several devices (moelora.parallel, docs/parallel.md)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks: one process per device")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="partition the routed experts over the ranks instead of splitting each one")


def _parallel(args) -> dict:
    return dict(tensor_parallel_size=args.tensor_parallel_size, expert_parallel=args.enable_expert_parallel)


def _llm(args, model: str, adapters: dict[str, str], **engine_kwargs):
    """`LLM` from the common flags (every adapter given gets a slot), plus `engine_kwargs`."""
    from moelora import LLM

    return LLM(model, adapters, device=args.device, dtype=args.dtype, max_lora_rank=args.max_lora_rank,
               max_loras=max(args.max_loras, len(adapters)), quantization=args.quantization,
               hf_overrides=types.hf_overrides(args), **engine_kwargs)


def cmd_generate(args) -> int:
    from moelora import SamplingParams

    model, adapters = _model_and_adapters(args)
    llm = _llm(args, model, adapters)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    names = args.adapter or [None]
    for name in names:
        adapter = None if name in (None, "base") else name
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, adapter)
        else:
            outs = llm.generate(args.prompts, params, adapter)
        for prompt, out in zip(args.prompts, outs, strict=True):
            print(f"[{name or 'base'}] {prompt!r} -> {out.text!r} ({out.finish_reason})")
    return 0


def cmd_verify(args) -> int:
    from moelora.verify import verify

    model, adapters = _model_and_adapters(args)  # --quantization is refused by cli_args.check_args
    worst = verify(model, adapters, tolerance=args.tolerance, print_fn=print)
    return 0 if worst <= args.tolerance else 1


def cmd_demo(args) -> int:
    import torch

    from moelora.demo.show import show_demo

    # The demo model is tiny: one intra-op thread beats several (70 s -> 2.6 s on a busy 2-core
    # machine, where extra threads spin against other processes). Set by the command, not the library.
    torch.set_num_threads(1)

    wrong = show_demo(device=args.device)
    return 0 if wrong == 0 else 1


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cmd_bench(args) -> int:
    import json

    import torch

    from moelora.bench import bench, format_runs

    model, adapters = _model_and_adapters(args)
    concs = args.conc
    eng = _llm(args, model, adapters, kernel_backend=args.kernel_backend, max_num_seqs=max(concs, default=1),
               enforce_eager=args.enforce_eager, piecewise_graph_tokens=args.max_cudagraph_capture_size,
               gpu_memory_utilization=args.gpu_memory_utilization, **_parallel(args),
               progress=True).engine
    where = torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu"
    graphs = eng.graphs is not None
    print(f"moelora bench: {model} on {where}, {eng.cfg.dtype}, kernels {eng.cfg.kernel_backend}, "
          f"{'CUDA graphs' if graphs else 'eager'}; adapters: {', '.join(eng.pool.names) or 'none'}; "
          f"prompts of {args.prompt_len} tokens, {args.steps} decode steps timed, median of {args.repeats}")
    runs = bench(eng, concs, args.prompt_len, args.steps, args.repeats)
    print(format_runs(runs))
    if args.json:
        meta = dict(model=str(model), device=where, dtype=eng.cfg.dtype, kernel_backend=eng.cfg.kernel_backend,
                    cuda_graphs=graphs, adapters=eng.pool.names, prompt_len=args.prompt_len,
                    steps=args.steps, repeats=args.repeats, torch=torch.__version__)
        rows = [dict(workload=r.workload, conc=r.conc, step_ms=r.step_s * 1e3, tokens_per_s=r.tokens_per_s,
                     prefill_ms=r.prefill_s * 1e3) for r in runs]
        with open(args.json, "w") as f:
            json.dump(dict(meta, runs=rows), f, indent=1)
    return 0


# serve ------------------------------------------------------------------------------------------


def serve_engine_config(args) -> EngineConfig:
    """The engine config of `moelora serve` (its flags follow vLLM's names where vLLM has one)."""
    from moelora.engine.config import EngineConfig

    return EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                        enforce_eager=args.enforce_eager, piecewise_graph_tokens=args.max_cudagraph_capture_size,
                        kernel_backend=args.kernel_backend, async_adapter_loading=not args.no_async_adapter_loading,
                        async_scheduling=args.async_scheduling,
                        overlap_shared_experts=not args.no_overlap_shared_experts,
                        overlap_lora=not args.no_overlap_lora, pdl=not args.no_pdl,
                        lora_target_modules=tuple(args.lora_target_modules) if args.lora_target_modules else None,
                        enable_prefix_caching=args.enable_prefix_caching, fused_moe_table=args.fused_moe_table,
                        scheduling_policy=args.scheduling_policy,
                        structured_any_whitespace=not (args.structured_outputs_config or {}).get(
                            "disable_any_whitespace", False),
                        warmup=not args.skip_warmup, quantization=args.quantization,
                        hf_overrides=types.hf_overrides(args),
                        fp8_activation_quant=args.fp8_activation_quant, nnodes=args.nnodes,
                        master_addr=args.master_addr, master_port=args.master_port if args.nnodes > 1 else 0,
                        **_parallel(args))


def serve_options(args) -> dict:
    """The `ServerConfig` fields `moelora serve`'s flags (and vLLM's environment variables) set."""
    return dict(api_keys=types.api_keys(args.api_key),
                allow_runtime_lora_updating=(args.allow_runtime_lora_updating
                                             or types.env_true("VLLM_ALLOW_RUNTIME_LORA_UPDATING")),
                lora_roots=tuple(args.lora_root or ()), max_logprobs=args.max_logprobs,
                enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                enable_log_requests=args.enable_log_requests and not args.disable_log_requests,
                log_stats_interval_s=0.0 if args.disable_log_stats else 10.0,
                allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
                allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
                tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                reasoning_parser=args.reasoning_parser or (args.structured_outputs_config or {}).get(
                    "reasoning_parser") or None, response_role=args.response_role,
                structured_in_reasoning=bool((args.structured_outputs_config or {}).get("enable_in_reasoning")),
                chat_template_content_format="openai" if args.chat_template_content_format == "openai" else "string",
                disable_fastapi_docs=args.disable_fastapi_docs,
                enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                enable_force_include_usage=args.enable_force_include_usage,
                default_chat_template_kwargs=args.default_chat_template_kwargs,
                enable_server_load_tracking=args.enable_server_load_tracking,
                max_log_len=4096 if args.max_log_len is None else args.max_log_len)


def serve_adapters(args) -> tuple[str, dict[str, str]]:
    """The model and every adapter `serve` registers: the demo's (no MODEL), --lora and --lora-modules."""
    from moelora.server.launch import parse_lora_modules

    model, adapters = _model_and_adapters(args)
    for name, path in parse_lora_modules(args.lora_modules).items():
        if name in adapters and adapters[name] != path:
            raise MoeLoRAError(f"adapter {name!r} is given twice with different paths")
        adapters[name] = path
    return model, adapters


def cmd_serve(args) -> int:
    if args.headless:  # a node other than rank 0's: its ranks only (moelora.parallel.node)
        from moelora.parallel.node import run_node

        return run_node(args.master_addr, args.master_port, args.nnodes, args.node_rank)
    import torch

    from moelora.server.launch import build_server, run_server

    model, adapters = serve_adapters(args)
    for msg in vllm_flags.ignored_flags(args):
        log.warning(msg)
    names = args.served_model_name or ([args.model] if args.model else ["moelora-demo"])
    if args.seed is not None:
        torch.manual_seed(args.seed)  # requests without a seed of their own draw from it
    app = build_server(model, adapters, serve_engine_config(args), names, args.max_waiting_requests, progress=True,
                       load_format=args.load_format, tokenizer=args.tokenizer, chat_template=args.chat_template,
                       seed=args.seed or 0, generation_config=args.generation_config,
                       override_generation_config=args.override_generation_config, **serve_options(args))
    run_server(app, args.host, args.port, args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
               root_path=args.root_path, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
               ssl_ca_certs=args.ssl_ca_certs)
    return 0


def _serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (vLLM's flag and endpoint names)")
    _common(serve)
    serve.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH|JSON",
                       help='adapters, as name=path or {"name": ..., "path": ...}')
    serve.add_argument("--enable-lora", action="store_true", help="accepted for vLLM compatibility (always on)")
    serve.add_argument("--served-model-name", nargs="+", help="names of the base model (default: MODEL)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=types.port, default=8000)
    serve.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept in host memory (page-locked unless --no-async-adapter-loading); "
                            "default max(32, --max-loras)")
    serve.add_argument("--lora-target-modules", nargs="+", metavar="MODULE", default=None,
                       help="modules that carry LoRA (e.g. q_proj k_proj v_proj o_proj experts), or 'auto': those "
                            "the --lora-modules adapters have LoRA on; the others launch no LoRA kernels and "
                            "adapters with LoRA elsewhere are refused (default: all)")
    serve.add_argument("--max-num-seqs", type=types.positive, default=64)
    serve.add_argument("--max-model-len", type=types.positive, default=None)
    serve.add_argument("--max-num-batched-tokens", type=types.positive, default=None,
                       help="tokens one step computes at most (chunked prefill); default 8192 on a GPU of >= 70 GiB "
                       "(H100 / H200), else 2048")
    serve.add_argument("--block-size", type=types.positive, default=16, help="tokens a KV cache block holds")
    serve.add_argument("--fp8-activation-quant", action=argparse.BooleanOptionalAction, default=None,
                       help="FP8 weights: also quantize the activations (per token and 128 columns) and multiply on "
                            "FP8 tensor cores (W8A8, within a documented error bound: README); --no-: W8A16, the "
                            "weights upcast in the kernels. Default: W8A8 on the GPU (faster at every batch size "
                            "measured on the H200), W8A16 on kernel_backend torch")
    _engine_flags(serve)
    serve.add_argument("--no-async-adapter-loading", action="store_true",
                       help="write adapter slots on the main stream (off switch of the side-stream loads)")
    serve.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="launch each step before reading the previous one back (default: on with CUDA)")
    serve.add_argument("--no-overlap-shared-experts", action="store_true",
                       help="run shared experts on the main stream (off switch of the second stream)")
    serve.add_argument("--no-pdl", action="store_true",
                       help="launch the Triton kernels without programmatic dependent launch (its off switch)")
    serve.add_argument("--no-overlap-lora", action="store_true",
                       help="run the LoRA shrink / expert down delta on the main stream (off switch of the "
                            "LoRA side stream)")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV of shared prompt prefixes (default on)")
    serve.add_argument("--disable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="same as --no-enable-prefix-caching")
    serve.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                       help="fcfs (default), or priority: requests' `priority` (lower first) orders the waiting "
                            "queue and picks the preemption victim (the lowest priority, newest)")
    serve.add_argument("--skip-warmup", action="store_true",
                       help="report ready (/health 200) without first running every kernel shape once: a faster "
                            "start, but the first requests pay the Triton compiles")
    serve.add_argument("--fused-moe-table", default=None, metavar="JSON",
                       help="tuned fused-MoE launch configs (benchmarks/tune_fused_moe.py's output) to use instead "
                            "of the package's table for the GPU")
    serve.add_argument("--max-waiting-requests", type=int, default=1024,
                       help="answer 503 (Retry-After) while this many requests wait to be scheduled")
    serve.add_argument("--uvicorn-log-level", default="info")
    _serve_vllm_flags(serve)
    _serve_node_flags(serve)
    serve.set_defaults(func=cmd_serve, parser=serve)


def _serve_node_flags(serve: argparse.ArgumentParser) -> None:
    """Several hosts (vLLM's multiprocessing multi-node flags; torchrun's environment variables as defaults)."""
    env = os.environ
    serve.add_argument("--nnodes", type=types.positive, default=env.get("NNODES", "1"),
                       help="nodes the --tensor-parallel-size ranks are spread over, evenly (default: $NNODES, else 1)")
    serve.add_argument("--node-rank", type=types.non_negative, default=env.get("NODE_RANK", "0"),
                       help="this node: 0 runs the server and rank 0, the others --headless (default: $NODE_RANK)")
    serve.add_argument("--master-addr", default=env.get("MASTER_ADDR", "127.0.0.1"),
                       help="node 0's address every node can reach: the rendezvous (default: $MASTER_ADDR, else "
                            "127.0.0.1)")
    serve.add_argument("--master-port", type=types.port, default=env.get("MASTER_PORT", "29501"),
                       help="the rendezvous port on --master-addr when --nnodes > 1 (default: $MASTER_PORT, "
                            "else 29501)")
    serve.add_argument("--headless", action="store_true",
                       help="a node other than 0: run this node's ranks for node 0's engine, no server; the model "
                            "and engine flags are node 0's")


def _serve_vllm_flags(serve: argparse.ArgumentParser) -> None:
    """vLLM's serve flags beyond the engine's: access, tokenizer, defaults, logging, loading."""
    serve.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                       help="require Authorization: Bearer KEY on every route but /health, /ping, /metrics, /version "
                            "(default: $MOELORA_API_KEY, else $VLLM_API_KEY, else none)")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (also: "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    serve.add_argument("--lora-root", action="append", metavar="DIR",
                       help="a runtime adapter load may read only inside these directories (repeatable)")
    serve.add_argument("--chat-template", default=None, help="chat template: a file, or the jinja template itself")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto" (the default with tools): the reply\'s calls parsed into tool_calls')
    serve.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="how the model writes a call: hermes (Qwen2.5 / Qwen3, Qwen3-MoE included; Hermes), "
                            "deepseek_v3 / deepseek_v31 (DeepSeek-V3 / R1 / V3.1), glm45 (GLM-4.5 / 4.6), "
                            "qwen3_coder (Qwen3-Coder), kimi_k2 (Kimi-K2)")
    serve.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help='tool_choice "none": render the chat template without the tools')
    serve.add_argument("--structured-outputs-config", type=types.structured_outputs_config, default=None,
                       metavar="JSON", help='vLLM\'s: {"backend": "auto" | "xgrammar", "disable_any_whitespace": '
                       'compact JSON outputs, "enable_in_reasoning": the format holds the reasoning too, '
                       '"reasoning_parser": as --reasoning-parser}')
    serve.add_argument("--guided-decoding-backend", type=types.structured_backend, default="auto",
                       help="accepted for vLLM < 0.10.2 command lines: auto or xgrammar (the one backend here)")
    serve.add_argument("--enable-reasoning", action="store_true",
                       help="accepted for vLLM < 0.10 command lines: --reasoning-parser alone turns reasoning on")
    serve.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="a thinking model's <think> ... </think> text as the message's reasoning (and "
                            "reasoning_content), apart from its content: deepseek_r1 (DeepSeek-R1, QwQ), qwen3, glm45, "
                            "deepseek_v3 (V3.1)")
    serve.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer directory (default: MODEL)")
    serve.add_argument("--seed", type=int, default=None, help="seed of requests without one (and of dummy weights)")
    serve.add_argument("--max-logprobs", type=types.non_negative, default=20,
                       help="the most logprobs / top_logprobs a request may ask for")
    serve.add_argument("--generation-config", default="auto",
                       help="default sampling fields from generation_config.json: auto (the model's), vllm (none) "
                            "or a directory")
    serve.add_argument("--enable-tokenizer-info-endpoint", action="store_true", help="serve GET /tokenizer_info")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprob tokens as 'token_id:{id}'")
    serve.add_argument("--enable-log-requests", action="store_true", help="log every request's fields")
    serve.add_argument("--disable-log-requests", action="store_true", help="do not log requests (the default)")
    serve.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log line")
    serve.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default="auto",
                       help="dummy: random weights of config.json's shapes (no checkpoint needed)")
    serve.add_argument("--allowed-origins", type=types.json_strings, default=["*"], metavar="JSON",
                       help='CORS: origins a browser client may call from, a JSON list (default ["*"])')
    serve.add_argument("--allowed-methods", type=types.json_strings, default=["*"], metavar="JSON",
                       help='CORS: allowed methods, a JSON list (default ["*"])')
    serve.add_argument("--allowed-headers", type=types.json_strings, default=["*"], metavar="JSON",
                       help='CORS: allowed headers, a JSON list (default ["*"])')
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    serve.add_argument("--disable-uvicorn-access-log", action="store_true", help="no uvicorn access log line a request")
    serve.add_argument("--root-path", default="", help="the ASGI root path behind a path-based proxy (uvicorn's)")
    serve.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key file (with --ssl-certfile)")
    serve.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate file (with --ssl-keyfile)")
    serve.add_argument("--ssl-ca-certs", default=None, help="HTTPS: CA certificates for client certificates")
    serve.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream ends with a usage chunk, as if stream_options.include_usage were set")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache supplied")
    serve.add_argument("--response-role", default="assistant",
                       help="the role of the reply's message when add_generation_prompt is on (default assistant)")
    serve.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"], default="auto",
                       help="how a message's content reaches the chat template: string (auto: the same), or "
                            "openai: a list of {type: text, text} parts")
    serve.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM compatibility: moelora builds its model classes itself and never runs "
                            "a checkpoint's code")
    serve.add_argument("--enable-chunked-prefill", action="store_true",
                       help="accepted for vLLM compatibility (always on: --max-num-batched-tokens a step)")
    serve.add_argument("--kv-cache-dtype", choices=["auto"], default="auto",
                       help="the KV cache's dtype: auto, the model's (the only one served)")
    serve.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                       help="accepted for vLLM compatibility: a preempted request's KV is recomputed, never swapped")
    serve.add_argument("--download-dir", default=None, metavar="DIR",
                       help="accepted for vLLM compatibility: MODEL is a local directory, nothing is downloaded")
    for flag in ("--revision", "--tokenizer-revision", "--code-revision"):
        serve.add_argument(flag, default=None, metavar="REV",
                           help="accepted for vLLM compatibility: MODEL is a local directory, read as it is")
    serve.add_argument("--tokenizer-mode", choices=["auto"], default="auto",
                       help="the tokenizer.json fast tokenizer (the only mode)")
    serve.add_argument("--pipeline-parallel-size", "-pp", type=types.positive, default=1,
                       help="1 only: moelora splits a model over devices by --tensor-parallel-size (and "
                            "--enable-expert-parallel), not by layers")
    serve.add_argument("--data-parallel-size", "-dp", type=types.positive, default=1,
                       help="1 only: one engine a server (run several servers for data parallelism)")
    serve.add_argument("--distributed-executor-backend", choices=["mp"], default="mp",
                       help="mp: one process a rank (the only backend)")
    serve.add_argument("--disable-custom-all-reduce", action="store_true",
                       help="accepted for vLLM compatibility: the ranks all-reduce through NCCL / gloo only")
    vllm_flags.add_flags(serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moelora", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with the base model and adapters")
    _common(gen)
    gen.add_argument("--adapter", action="append", help="adapter name per run ('base' for none); repeatable")
    gen.add_argument("--prompt", dest="prompts", action="append", required=True, help="a prompt; repeatable")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=types.positive, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append")
    gen.set_defaults(func=cmd_generate, parser=gen)
    ver = sub.add_parser("verify", help="compare logits with transformers + PEFT (needs the dev extra)")
    _common(ver)
    ver.add_argument("--tolerance", type=float, default=1e-3)
    ver.set_defaults(func=cmd_verify, parser=ver)
    demo = sub.add_parser("demo", help="the bundled model: base and every adapter on the same inputs")
    demo.add_argument("--device", type=types.device, default=None)
    demo.set_defaults(func=cmd_demo)
    _serve_parser(sub)
    b = sub.add_parser("bench", help="decode throughput with and without the adapters, on this machine")
    _common(b)
    b.add_argument("--conc", type=_ints, default=[1, 8, 32], help="concurrencies, comma-separated (default 1,8,32)")
    b.add_argument("--prompt-len", type=types.positive, default=128, help="prompt tokens a request (random ids)")
    b.add_argument("--steps", type=types.positive, default=32, help="decode steps timed a run")
    b.add_argument("--repeats", type=types.positive, default=3, help="rounds of every workload (medians)")
    _engine_flags(b)
    b.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    b.set_defaults(func=cmd_bench, parser=b)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = vllm_flags.expand_config_file(sys.argv[1:] if argv is None else list(argv))
    except MoeLoRAError as e:  # --config FILE unreadable: one `error:` line, exit 2, as for any bad flag
        parser.error(str(e))
    args = parser.parse_args(types.merge_dotted(argv))
    try:
        if args.command == "serve":
            types.check_node_args(args.parser, args)
        if args.command != "demo" and not getattr(args, "headless", False):  # checks before a model is loaded
            _, adapters = serve_adapters(args) if args.command == "serve" else _model_and_adapters(args)
            types.check_args(args.parser, args, adapters)
        return args.func(args)
    except MoeLoRAError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


