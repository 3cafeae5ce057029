"""vLLM serve flags for machinery moelora does not have (`moelora.vllm_flags`): a vLLM launch line holding them
starts, each ignored one named in the start-up log; the ones that would change what is served are refused with the
reason; `--config FILE` reads a YAML file of flags under the command line's own, as vLLM's parser does."""

from __future__ import annotations

import logging

import pytest

from moelora.cli import build_parser, main
from moelora.cli_args import merge_dotted
from moelora.errors import ConfigError
from moelora.vllm_flags import expand_config_file, ignored_flags

IGNORED = [  # (flags, a phrase of the start-up note)
    (["--cuda-graph-sizes", "1", "2", "4"], "every 16 up to --max-num-seqs"),
    (["--fully-sharded-loras"], "adapters follow their layers' split"),
    (["--enable-sleep-mode"], "sleep mode is not implemented"),
    (["--max-num-partial-prefills", "2"], "chunked by --max-num-batched-tokens alone"),
    (["--long-prefill-token-threshold", "512"], "chunked by --max-num-batched-tokens alone"),
    (["--max-parallel-loading-workers", "4"], "read one after another"),
    (["--calculate-kv-scales"], "has no scales"),
]


@pytest.mark.parametrize("flags,says", IGNORED)
def test_each_ignored_flag_is_named_at_start_up(flags, says):
    said = ignored_flags(build_parser().parse_args(["serve", *flags]))
    assert len(said) == 1 and says in said[0]


def test_a_launch_line_with_them_starts_and_logs_them(monkeypatch, caplog):
    from moelora.server import launch

    seen = {}
    monkeypatch.setattr(launch, "build_server", lambda *a, **k: seen.setdefault("kw", k) and "app")
    monkeypatch.setattr(launch, "run_server", lambda *a, **k: None)
    flags = [f for fl, _ in IGNORED for f in fl] + [
        "--disable-frontend-multiprocessing", "--disable-sliding-window", "--model-impl", "vllm", "--hf-token", "t",
        "--lora-dtype", "auto", "--logprobs-mode", "raw_logprobs", "--cpu-offload-gb", "0",
        "--override-generation-config", '{"temperature": 0.3}', "--default-chat-template-kwargs",
        '{"enable_thinking": false}', "--enable-server-load-tracking", "--max-log-len", "100"]
    with caplog.at_level(logging.WARNING, logger="moelora"):
        assert main(["serve", *flags]) == 0
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(says in logged for _, says in IGNORED)
    kw = seen["kw"]
    assert kw["override_generation_config"] == {"temperature": 0.3}
    assert (kw["default_chat_template_kwargs"], kw["enable_server_load_tracking"], kw["max_log_len"]) == (
        {"enable_thinking": False}, True, 100)


@pytest.mark.parametrize("flags,says", [
    (["--cpu-offload-gb", "4"], "offloading weights to host memory is not implemented"),
    (["--lora-dtype", "float16", "--dtype", "bfloat16"], "LoRA weights are held in the model's dtype"),
    (["--logprobs-mode", "processed_logprobs"], "invalid choice"),
    (["--model-impl", "transformers"], "invalid choice"),
])
def test_settings_that_would_change_what_is_served_are_refused(flags, says, capsys, monkeypatch):
    from moelora.server import launch

    monkeypatch.setattr(launch, "build_server", lambda *a, **k: pytest.fail("refused flags reached the server"))
    with pytest.raises(SystemExit):
        main(["serve", *flags])
    assert says in capsys.readouterr().err


def test_lora_dtype_equal_to_the_models_is_accepted(monkeypatch):
    from moelora.server import launch

    monkeypatch.setattr(launch, "build_server", lambda *a, **k: "app")
    monkeypatch.setattr(launch, "run_server", lambda *a, **k: None)
    assert main(["serve", "--lora-dtype", "bfloat16", "--dtype", "bfloat16"]) == 0


def test_config_file_flags_sit_under_the_command_line(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: /models/m\nport: 9000\nmax_num_seqs: 8\nenable-prefix-caching: true\n"
                   "enforce-eager: false\nserved-model-name: [a, b]\nspeculative-config: {method: mtp}\n"
                   "speculative-config.num_speculative_tokens: 2\n")
    args = build_parser().parse_args(merge_dotted(expand_config_file(["serve", "--config", str(cfg), "--port",
                                                                      "7000"])))
    assert (args.model, args.port, args.max_num_seqs, args.enable_prefix_caching) == ("/models/m", 7000, 8, True)
    assert not args.enforce_eager and args.served_model_name == ["a", "b"]
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    # MODEL on the command line wins; a list-valued flag of the file does not swallow it
    argv = expand_config_file(["serve", "/models/cli", f"--config={cfg}"])
    args = build_parser().parse_args(merge_dotted(argv))
    assert args.model == "/models/cli" and args.served_model_name == ["a", "b"]
    assert expand_config_file(["serve", "--port", "1"]) == ["serve", "--port", "1"]


@pytest.mark.parametrize("text,says", [("- a\n- b\n", "must hold a mapping"), ("port: [1\n", "--config")])
def test_config_file_refusals(tmp_path, text, says):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=says):
        expand_config_file(["serve", "--config", str(cfg)])
    with pytest.raises(ConfigError, match="No such file"):
        expand_config_file(["serve", "--config", str(tmp_path / "missing.yaml")])


def test_an_unreadable_config_file_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--config", str(tmp_path / "missing.yaml")])
    assert exit_.value.code == 2 and "error: --config" in capsys.readouterr().err


def test_main_reads_the_config_file(tmp_path, monkeypatch):
    from moelora.server import launch

    seen = {}
    monkeypatch.setattr(launch, "build_server", lambda *a, **k: seen.setdefault("kw", k) and "app")
    monkeypatch.setattr(launch, "run_server", lambda app, host, port, *a, **k: seen.setdefault("port", port))
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 8123\ndefault-chat-template-kwargs: {enable_thinking: false}\n")
    assert main(["serve", "--config", str(cfg)]) == 0
    assert seen["port"] == 8123 and seen["kw"]["default_chat_template_kwargs"] == {"enable_thinking": False}
