"""The command line: `moelora verify` against transformers + PEFT, argument errors."""

from __future__ import annotations

import json

import pytest

from moelora.cli import main
from tests.helpers.oracle import tiny_hf_model
from tests.helpers.oracle_lora import build_peft_adapter


def test_verify_reports_each_adapter(tmp_path, capsys):
    hf = tiny_hf_model("qwen3_moe", seed=5)
    hf.save_pretrained(str(tmp_path / "m"))
    adapter = build_peft_adapter(hf, tmp_path / "ad", seed=4, r=4)
    rc = main(["verify", str(tmp_path / "m"), "--lora", f"mine={adapter}", "--tolerance", "1e-4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "base" in out and "mine" in out and out.count(" ok") == 2


def test_verify_catches_a_mismatch_and_a_broken_checkpoint(tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file, save_file

    from moelora.models.decoder import MoECausalLM

    hf = tiny_hf_model("qwen3_moe", seed=5)
    hf.save_pretrained(str(tmp_path / "m"))
    adapter = build_peft_adapter(hf, tmp_path / "ad", seed=4, r=4)
    original = MoECausalLM.set_lora_slot
    monkeypatch.setattr(MoECausalLM, "set_lora_slot", lambda self, slot, ad: original(self, slot, None))
    rc = main(["verify", str(tmp_path / "m"), "--lora", f"mine={adapter}"])
    out = capsys.readouterr().out
    assert rc == 1 and "MISMATCH" in out  # moelora silently dropping the adapter is reported
    monkeypatch.undo()
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["model.layers.0.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    rc = main(["verify", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert rc == 2 and "CheckpointError" in err and "model.layers.0.self_attn.k_proj.weight" in err


def one_error_line(capsys, *words) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and all(w in lines[0] for w in words), err
    return lines[0]


@pytest.fixture
def no_loading(monkeypatch):
    """Any model or engine construction fails the test: the flags must be refused before."""
    from moelora import llm
    from moelora.server import launch

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(launch, "build_server", boom)
    monkeypatch.setattr(llm.LLM, "__init__", boom)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "m"
    tiny_hf_model("qwen3_moe", seed=5).save_pretrained(str(out))
    return out


BAD_FLAGS = [
    (["serve", "--device", "tpu"], "--device"), (["generate", "--device", "tpu", "--prompt", "x"], "--device"),
    (["serve", "--port", "99999"], "--port"), (["serve", "--port", "http"], "--port"),
    (["demo", "--device", "tpu"], "--device"),
    (["verify", "--lora", "noequals"], "NAME=PATH"), (["serve", "--lora", "=x"], "NAME=PATH"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs"), (["serve", "--max-loras", "-1"], "--max-loras"),
    (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["serve", "--dtype", "float8"], "--dtype"), (["serve", "--load-format", "pt"], "--load-format"),
    (["serve", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["serve", "--block-size", "x"], "--block-size"), (["serve", "--max-logprobs", "-2"], "--max-logprobs"),
    (["bench", "--conc", "0,8"], "--conc"), (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["serve", "--max-loras", "0"], "--max-loras 0"),  # the demo's adapters need slots
    (["serve", "--chat-template", "no_such_template.jinja"], "--chat-template"),
    (["serve", "--tokenizer", "/no/such/dir"], "--tokenizer"),
    (["serve", "--generation-config", "/no/such/dir"], "--generation-config"),
    (["serve", "--lora-root", "/no/such/dir"], "--lora-root"),
    (["serve", "/no/such/model"], "config.json"),
    (["serve", "--lora-modules", "oops"], "--lora-modules"),
    (["serve", "--enable-auto-tool-choice"], "--tool-call-parser"),
    (["serve", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"], "--tool-call-parser"),
    (["serve", "--reasoning-parser", "granite"], "--reasoning-parser"),
    (["serve", "--enable-reasoning"], "--reasoning-parser"),
    (["serve", "-pp", "2"], "--pipeline-parallel-size 2"), (["serve", "--data-parallel-size", "2"], "--data-parallel"),
    (["serve", "--distributed-executor-backend", "ray"], "--distributed-executor-backend"),
    (["serve", "--ssl-certfile", "/no/cert.pem"], "--ssl-keyfile"),
    (["serve", "--ssl-certfile", "/no/cert.pem", "--ssl-keyfile", "/no/key.pem"], "does not exist"),
]


@pytest.mark.parametrize("argv,words", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_error_line_and_status_2_before_loading(argv, words, capsys, no_loading):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's way
        rc = e.code
    assert rc == 2
    one_error_line(capsys, words)


def test_max_loras_0_with_adapters_and_missing_adapters_are_refused_before_loading(model_dir, capsys, no_loading):
    with pytest.raises(SystemExit) as e:
        main(["generate", str(model_dir), "--max-loras", "0", "--lora", f"a={model_dir}", "--prompt", "x"])
    assert e.value.code == 2
    one_error_line(capsys, "--max-loras 0", "'a'")
    with pytest.raises(SystemExit) as e:
        main(["serve", str(model_dir), "--lora", "a=/no/such/adapter"])
    assert e.value.code == 2
    one_error_line(capsys, "'a'", "/no/such/adapter")


@pytest.mark.parametrize("module", ["moelora", "moelora.cli"])  # `python -m moelora` is the command too
def test_the_real_command_exits_2_with_one_error_line(module):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", module, "serve", "--port", "99999"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert lines == ["moelora serve: error: argument --port: 99999 is not a TCP port (0..65535)"], r.stderr


def test_a_shape_mismatch_names_the_adapter(model_dir, tmp_path, capsys):
    other = tiny_hf_model("qwen3_moe", seed=5, hidden_size=64)  # the served model has 48
    adapter = build_peft_adapter(other, tmp_path / "ad", seed=4, r=4)
    assert main(["verify", str(model_dir), "--lora", f"mine={adapter}"]) == 2
    line = one_error_line(capsys, "AdapterError", "'mine'", "shape mismatch", "(4, 64)", "(4, 48)")
    assert line.startswith("error: ")


def test_serve_flags_reach_the_engine_config():
    from moelora.cli import build_parser, serve_engine_config

    args = build_parser().parse_args(["serve", "--no-async-adapter-loading", "--async-scheduling",
                                      "--kernel-backend", "torch",
                                      "--no-overlap-shared-experts", "--no-enable-prefix-caching", "--enforce-eager",
                                      "--no-overlap-lora", "--max-loras", "3", "--lora-target-modules", "q_proj",
                                      "experts", "--fused-moe-table", "mine.json", "--no-pdl"])
    cfg = serve_engine_config(args)
    assert (cfg.async_adapter_loading, cfg.async_scheduling, cfg.kernel_backend, cfg.overlap_shared_experts,
            cfg.overlap_lora, cfg.enable_prefix_caching, cfg.enforce_eager, cfg.max_loras, cfg.pdl) == (
                False, True, "torch", False, False, False, True, 3, False)
    assert cfg.lora_target_modules == ("q_proj", "experts")
    assert cfg.fused_moe_table == "mine.json"
    default = serve_engine_config(build_parser().parse_args(["serve"]))
    assert (default.async_adapter_loading, default.async_scheduling, default.kernel_backend,
            default.overlap_shared_experts, default.overlap_lora, default.enable_prefix_caching, default.pdl) == (
                True, None, None, True, True, True, True)
    assert default.lora_target_modules is None and default.fused_moe_table is None
    assert serve_engine_config(build_parser().parse_args(["serve", "--no-async-scheduling"])).async_scheduling is False
    assert default.piecewise_graph_tokens == 2048
    assert serve_engine_config(build_parser().parse_args(
        ["serve", "--max-cudagraph-capture-size", "0"])).piecewise_graph_tokens == 0  # vLLM's name


def test_vllm_serve_flags_reach_the_configs(monkeypatch):
    from moelora.cli import build_parser, serve_engine_config, serve_options

    parse = lambda *argv: build_parser().parse_args(["serve", *argv])  # noqa: E731
    cfg = serve_engine_config(parse("--max-num-batched-tokens", "512", "--block-size", "32"))
    assert (cfg.max_num_batched_tokens, cfg.block_size, cfg.enable_prefix_caching) == (512, 32, True)
    assert cfg.scheduling_policy == "fcfs" and serve_engine_config(
        parse("--scheduling-policy", "priority")).scheduling_policy == "priority"
    so = parse("--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true, '
               '"enable_in_reasoning": true, "reasoning_parser": "qwen3", "disable_fallback": true}',
               "--guided-decoding-backend", "xgrammar")
    assert serve_engine_config(so).structured_any_whitespace is False and cfg.structured_any_whitespace is True
    opts = serve_options(so)
    assert opts["structured_in_reasoning"] is True and opts["reasoning_parser"] == "qwen3"
    for flags, on in ((["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False),
                      (["--disable-prefix-caching"], False)):
        assert serve_engine_config(parse(*flags)).enable_prefix_caching is on, flags
    for var in ("MOELORA_API_KEY", "VLLM_API_KEY", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(var, raising=False)
    default = serve_options(parse())
    cors = dict(allowed_origins=("*",), allowed_methods=("*",), allowed_headers=("*",), allow_credentials=False)
    tools_off = dict(tool_call_parser=None, exclude_tools_when_tool_choice_none=False, reasoning_parser=None,
                     response_role="assistant", chat_template_content_format="string", disable_fastapi_docs=False,
                     enable_prompt_tokens_details=False, enable_force_include_usage=False,
                     structured_in_reasoning=False, default_chat_template_kwargs=None,
                     enable_server_load_tracking=False, max_log_len=4096)
    assert default == dict(api_keys=(), allow_runtime_lora_updating=False, lora_roots=(), max_logprobs=20,
                           enable_tokenizer_info_endpoint=False, return_tokens_as_token_ids=False,
                           enable_log_requests=False, log_stats_interval_s=10.0, **cors, **tools_off)
    opts = serve_options(parse("--api-key", "a", "b", "--allow-runtime-lora-updating", "--lora-root", "/x",
                               "--lora-root", "/y", "--max-logprobs", "5", "--enable-tokenizer-info-endpoint",
                               "--return-tokens-as-token-ids", "--enable-log-requests", "--disable-log-stats",
                               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                               "--exclude-tools-when-tool-choice-none", "--reasoning-parser", "qwen3",
                               "--response-role", "bot", "--chat-template-content-format", "openai",
                               "--disable-fastapi-docs", "--enable-prompt-tokens-details",
                               "--enable-force-include-usage", "--default-chat-template-kwargs",
                               '{"enable_thinking": false}', "--enable-server-load-tracking", "--max-log-len", "80"))
    assert opts == dict(api_keys=("a", "b"), allow_runtime_lora_updating=True, lora_roots=("/x", "/y"),
                        max_logprobs=5, enable_tokenizer_info_endpoint=True, return_tokens_as_token_ids=True,
                        enable_log_requests=True, log_stats_interval_s=0.0, **cors, tool_call_parser="hermes",
                        exclude_tools_when_tool_choice_none=True, reasoning_parser="qwen3", response_role="bot",
                        chat_template_content_format="openai", disable_fastapi_docs=True,
                        enable_prompt_tokens_details=True, enable_force_include_usage=True,
                        structured_in_reasoning=False, default_chat_template_kwargs={"enable_thinking": False},
                        enable_server_load_tracking=True, max_log_len=80)
    # the parser alone (no --enable-auto-tool-choice) leaves "auto" off, as in vLLM
    assert serve_options(parse("--tool-call-parser", "hermes"))["tool_call_parser"] is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert serve_options(parse())["api_keys"] == ("from-vllm",)
    monkeypatch.setenv("MOELORA_API_KEY", "from-moelora")
    assert serve_options(parse())["api_keys"] == ("from-moelora",)
    assert serve_options(parse("--api-key", "flag"))["api_keys"] == ("flag",)
    for value, on in (("True", True), ("1", True), ("true", True), ("0", False), ("False", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert serve_options(parse())["allow_runtime_lora_updating"] is on, value
    assert [parse("--dtype", d).dtype for d in ("half", "float", "bfloat16", "auto")] == [
        "float16", "float32", "bfloat16", "auto"]
    args = parse("--seed", "7", "--load-format", "dummy", "--chat-template", "{{ x }}", "--generation-config", "vllm")
    assert (args.seed, args.load_format, args.chat_template, args.generation_config) == (7, "dummy", "{{ x }}", "vllm")


def test_a_vllm_command_line_of_compatibility_flags_serves(monkeypatch, tmp_path):
    """vLLM deployment flags that change nothing here (or name the only mode) are accepted, and the TLS files reach
    uvicorn: `moelora serve` starts where `vllm serve` did."""
    from moelora.server import launch

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    seen = {}
    monkeypatch.setattr(launch, "build_server", lambda *a, **k: seen.setdefault("options", k) and "app")
    monkeypatch.setattr(launch, "run_server", lambda app, host, port, *a, **k: seen.setdefault("run", (app, k)))
    rc = main(["serve", "--revision", "main", "--tokenizer-mode", "auto", "-pp", "1", "-dp", "1",
               "--distributed-executor-backend", "mp", "--disable-custom-all-reduce", "--enable-reasoning",
               "--reasoning-parser", "deepseek_r1", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
               "--response-role", "bot", "--disable-fastapi-docs"])
    assert rc == 0 and seen["run"][0] == "app"
    assert (seen["run"][1]["ssl_keyfile"], seen["run"][1]["ssl_certfile"]) == (str(key), str(cert))
    assert seen["options"]["reasoning_parser"] == "deepseek_r1" and seen["options"]["response_role"] == "bot"


@pytest.mark.parametrize("flags,says", [
    (["--guided-decoding-backend", "guidance"], "xgrammar"),
    (["--structured-outputs-config", '{"backend": "outlines"}'], "xgrammar"),
    (["--structured-outputs-config", '{"whitespace": 1}'], "unknown structured outputs setting"),
    (["--structured-outputs-config", "[1]"], "a JSON object"),
])
def test_structured_output_flags_refuse_what_is_not_served(flags, says, capsys):
    from moelora.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])
    assert says in capsys.readouterr().err


def test_vllm_config_flags_parse_whole_and_key_by_key():
    """vLLM's JSON-object flags as its parser takes them, whole or `--flag.key value` / `--flag.key=value` (a value
    read as JSON where it parses), the keys over a whole object given first; -O LEVEL; the ones moelora has no
    machinery for are accepted and named in the start-up log."""
    from moelora.cli import build_parser
    from moelora.cli_args import merge_dotted
    from moelora.vllm_flags import ignored_flags

    argv = ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
            "--speculative-config.num_speculative_tokens", "1", "--speculative-config.method=mtp",
            "--speculative-config.draft.tp", "2", "-O3", "--enable-eplb", "--eplb-config", '{"window_size": 1000}',
            "--structured-outputs-config.backend=xgrammar", "--structured-outputs-config.disable_any_whitespace",
            "true", "--max-num-seqs", "4"]
    args = build_parser().parse_args(merge_dotted(argv))
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 1, "draft": {"tp": 2}}
    assert args.compilation_config == {"level": 3} and args.enable_eplb and args.eplb_config == {"window_size": 1000}
    assert args.structured_outputs_config == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert args.max_num_seqs == 4
    said = ignored_flags(args)
    assert len(said) == 3 and "speculative decoding is not implemented" in said[0] and "eplb" in said[2]
    plain = build_parser().parse_args(merge_dotted(["serve", "-O", '{"cudagraph_mode": "FULL"}']))
    assert plain.compilation_config == {"cudagraph_mode": "FULL"} and ignored_flags(plain)[0].startswith("--compil")
    assert ignored_flags(build_parser().parse_args(["serve"])) == []
    assert merge_dotted(["serve", "--model-x.y", "1"]) == ["serve", "--model-x.y", "1"]  # not a config flag
    eq = build_parser().parse_args(merge_dotted(["serve", '--eplb-config={"a": 1, "b": 2}', "--eplb-config.b", "3"]))
    assert eq.eplb_config == {"a": 1, "b": 3}


@pytest.mark.parametrize("flags,says", [
    (["--speculative-config", "mtp"], "a JSON object"),
    (["-O", "7"], "a JSON object"),
    (["--structured-outputs-config.backend", "outlines"], "xgrammar"),
])
def test_vllm_config_flags_refuse_what_does_not_parse(flags, says, capsys):
    from moelora.cli import build_parser
    from moelora.cli_args import merge_dotted

    with pytest.raises(SystemExit):
        build_parser().parse_args(merge_dotted(["serve", *flags]))
    assert says in capsys.readouterr().err


def test_main_reads_the_key_by_key_forms(monkeypatch):
    import moelora.cli as cli

    seen = []
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.append(args.speculative_config) or 0)
    assert cli.main(["serve", "--speculative-config.method", "mtp", "--speculative-config.num_speculative_tokens",
                     "2"]) == 0
    assert seen == [{"method": "mtp", "num_speculative_tokens": 2}]


def test_hf_overrides_and_rope_scaling_reach_the_engine_config(capsys):
    """vLLM's --hf-overrides (whole or key by key) and its older --rope-scaling; verify refuses them."""
    from moelora.cli import build_parser, main, serve_engine_config
    from moelora.cli_args import merge_dotted

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

    def cfg(*argv):
        return serve_engine_config(build_parser().parse_args(merge_dotted(["serve", *argv])))
    assert cfg().hf_overrides is None
    assert cfg("--rope-scaling", json.dumps(yarn)).hf_overrides == {"rope_scaling": yarn}
    assert cfg("--hf-overrides", '{"max_position_embeddings": 65536}', "--rope-scaling", json.dumps(yarn)
               ).hf_overrides == {"max_position_embeddings": 65536, "rope_scaling": yarn}
    assert cfg("--hf-overrides.rope_scaling.rope_type", "yarn", "--hf-overrides.rope_scaling.factor", "4.0",
               "--hf-overrides.rope_scaling.original_max_position_embeddings", "32768").hf_overrides == {
        "rope_scaling": yarn}
    with pytest.raises(SystemExit) as exit_:
        main(["verify", "--rope-scaling", json.dumps(yarn)])
    assert exit_.value.code == 2 and "--hf-overrides / --rope-scaling do not apply" in capsys.readouterr().err
