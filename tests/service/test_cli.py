"""`kvsentry` command line: every flag documented and wired to the engine config; the demo default."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import subprocess
import sys

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_args import ENGINE_ARGS
from service import cli, demo, server
from service.state import ServeSettings


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_engine_flag_defaults_to_the_configs_default(llama_path):
    """What `serve` runs without engine flags is what EngineConfig.create does without arguments,
    and every engine flag's default is the config's (the signature's, else the field's)."""
    actions = {action.dest: action for action in serve_parser()._actions}
    for arg in ENGINE_ARGS:
        action = actions[arg.name]
        parameter = inspect.signature(EngineConfig.create).parameters.get(arg.name)
        expected = parameter.default if parameter is not None and parameter.default is not inspect.Parameter.empty \
            else {f.name: f.default for f in dataclasses.fields(EngineConfig)}[arg.name]
        assert action.default == expected and type(action.default) is type(expected), arg.option
        assert "default" not in arg.help, f"{arg.option}: the formatter shows the default; do not restate it"
    args = cli.build_parser().parse_args(["serve", llama_path])
    assert EngineConfig.create(llama_path, **cli.engine_args(args)) == EngineConfig.create(llama_path)


def test_help_shows_the_configs_defaults():
    text = " ".join(subprocess.run([sys.executable, "-m", "service.cli", "serve", "--help"], capture_output=True,
                                   text=True, check=True).stdout.split())
    assert f"--nan-scan-blocks-per-step NAN_SCAN_BLOCKS_PER_STEP blocks the rolling scan checks per step " \
           f"(the most, under a budget) (default: {EngineConfig.nan_scan_blocks_per_step})" in text
    assert f"(default: {EngineConfig.nan_scan_budget})" in text
    assert f"(default: {EngineConfig.max_num_seqs})" in text


def test_every_http_flag_defaults_to_the_settings_default(captured, llama_path, monkeypatch):
    monkeypatch.delenv("KVSENTRY_API_KEY", raising=False)
    assert cli.main(["serve", llama_path]) == 0
    assert captured["settings"] == ServeSettings(served_model_names=(llama_path,))


def test_every_argument_has_help():
    for parser in (cli.build_parser(), serve_parser()):
        for action in parser._actions:
            assert action.help and action.help != argparse.SUPPRESS, action.option_strings or action.dest


def test_help_lists_every_flag():
    text = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--help"], capture_output=True,
                          text=True, check=True).stdout
    for action in serve_parser()._actions:
        for option in action.option_strings:
            assert option in text
    top = subprocess.run([sys.executable, "-m", "service.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "serve" in top and "generate" in top


@pytest.fixture
def captured(monkeypatch, tmp_path):
    """Runs `kvsentry serve ...` up to the point where it would start serving."""
    monkeypatch.setenv("KVSENTRY_CACHE_DIR", str(tmp_path / "cache"))
    calls = {}
    monkeypatch.setattr(server, "run", lambda config, client, settings, host, port: calls.update(
        config=config, settings=settings, host=host, port=port) or 0)
    monkeypatch.setattr(server, "run_headless", lambda config: calls.update(headless=config) or 0)
    monkeypatch.setattr("engine.dp.async_client.AsyncEngineClient.__init__", lambda self, config, **kw: None)
    return calls


def test_flags_reach_the_engine_config(captured, llama_path):
    code = cli.main(["serve", llama_path, "--port", "9999", "--host", "127.0.0.2", "--max-model-len", "256",
                     "--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                     "--kv-cache-memory", "32MiB", "--dtype", "float32", "--device", "cpu",
                     "--no-enable-prefix-caching", "--seed", "3", "--threads", "1", "--nan-sentinel", "full",
                     "--nan-scan-blocks-per-step", "8", "--nan-policy", "heal", "--data-parallel-size", "2",
                     "--data-parallel-size-local", "1", "--data-parallel-start-rank", "0",
                     "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", "31000",
                     "--served-model-name", "a", "b", "--api-key", "k", "--max-queued-requests", "7",
                     "--shutdown-timeout", "3", "--health-stall-timeout", "9", "--log-prompts",
                     "--enable-fault-injection", "--max-request-body-bytes", "1000", "--log-level", "warning"])
    assert code == 0
    config, settings = captured["config"], captured["settings"]
    assert (captured["host"], captured["port"]) == ("127.0.0.2", 9999)
    assert (config.max_model_len, config.block_size, config.max_num_seqs, config.max_num_batched_tokens) == \
        (256, 32, 8, 512)
    assert not config.enable_prefix_caching and config.seed == 3 and config.num_threads == 1
    assert (config.nan_sentinel, config.nan_scan_blocks_per_step, config.nan_policy) == ("full", 8, "heal")
    p = config.parallel
    assert (p.data_parallel_size, p.data_parallel_size_local, p.data_parallel_rpc_port) == (2, 1, 31000)
    assert settings.served_model_names == ("a", "b") and settings.api_key == "k"
    assert (settings.max_queued_requests, settings.shutdown_timeout, settings.health_stall_timeout) == (7, 3.0, 9.0)
    assert settings.log_prompts and settings.enable_fault_injection and settings.max_body_bytes == 1000


def test_no_model_serves_the_real_default_model(captured):
    from engine.gguf.default_model import DEFAULT_MODEL_NAME, default_model_path
    assert cli.main(["serve"]) == 0
    config, settings = captured["config"], captured["settings"]
    assert config.model.path == default_model_path() and config.model.path.endswith(".gguf")
    assert config.model.architecture == "LlamaForCausalLM" and config.model.num_layers == 30
    assert config.parallel.data_parallel_size == 1
    assert settings.served_model_names == (DEFAULT_MODEL_NAME,)


def test_demo_moe_serves_the_tiny_deepseek_with_two_ranks(captured, tmp_path, llama_path, capsys):
    assert cli.main(["serve", "--demo", "moe"]) == 0
    config, settings = captured["config"], captured["settings"]
    assert config.parallel.data_parallel_size == 2
    assert config.model.architecture == "DeepseekV3ForCausalLM"
    assert config.model.path.startswith(str(tmp_path / "cache"))
    assert settings.served_model_names == (demo.DEFAULT_DEMO_PRESET,)
    assert cli.main(["serve", "--demo", "moe", "--data-parallel-size", "1"]) == 0
    assert captured["config"].parallel.data_parallel_size == 1
    with pytest.raises(SystemExit):
        cli.main(["serve", llama_path, "--demo", "moe"])
    assert "not both" in capsys.readouterr().err


def test_tokenizer_flag_overrides_the_models_tokenizer(captured, llama_path, tmp_path):
    assert cli.main(["serve", llama_path, "--tokenizer", str(tmp_path)]) == 0
    assert captured["config"].model.tokenizer == str(tmp_path)


def test_headless_runs_only_the_local_ranks(captured, llama_path):
    assert cli.main(["serve", llama_path, "--headless", "--data-parallel-size", "2",
                     "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1"]) == 0
    assert "run" not in captured or "config" not in captured
    assert captured["headless"].parallel.data_parallel_start_rank == 1


def test_bad_engine_arguments_exit_2(captured, llama_path, capsys):
    assert cli.main(["serve", llama_path, "--block-size", "3"]) == 2
    assert "block_size" in capsys.readouterr().err
    assert cli.main(["serve", "/nonexistent/model"]) == 2


def test_demo_checkpoint_is_written_once(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSENTRY_CACHE_DIR", str(tmp_path))
    first = demo.default_demo_path("tiny-llama")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = demo.default_demo_path("tiny-llama")
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")], "no scratch left behind"


def test_a_vllm_tool_calling_command_line_serves(captured, llama_path, tmp_path):
    """The command lines of vLLM's docs: same meaning where kvsentry has it."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    code = cli.main(["serve", "--model", llama_path, "--served-model-name", "m", "--host", "127.0.0.3",
                     "--port", "8001", "--api-key", "k", "--dtype", "float", "--max-model-len", "256",
                     "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--kv-cache-memory-bytes", "16MiB",
                     "--tensor-parallel-size", "1", "-pp", "1", "-dp", "1", "--enable-expert-parallel",
                     "--no-enable-prefix-caching", "--enable-chunked-prefill", "--seed", "5",
                     "--tokenizer", llama_path, "--trust-remote-code", "--chat-template", str(template),
                     "--trust-request-chat-template", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                     "--reasoning-parser", "deepseek_r1", "--disable-log-requests", "--uvicorn-log-level", "info",
                     "--generation-config", "vllm", "--enforce-eager", "--block-size", "16", "--swap-space", "4",
                     "--max-logprobs", "5", "--disable-log-stats"])
    assert code == 0
    config, settings = captured["config"], captured["settings"]
    assert config.model.path == llama_path and (captured["host"], captured["port"]) == ("127.0.0.3", 8001)
    assert config.model.dtype == torch.float32 and config.max_model_len == 256 and config.max_num_seqs == 4
    assert config.max_num_batched_tokens == 128
    assert config.num_blocks == EngineConfig.create(llama_path, kv_cache_memory="16MiB", block_size=16, dtype="float32").num_blocks
    assert not config.enable_prefix_caching and config.seed == 5 and config.enforce_eager and config.block_size == 16
    assert settings.chat_template == template.read_text() and settings.trust_request_chat_template
    assert settings.tool_call_parser == "hermes" and settings.reasoning_parser == "deepseek_r1"
    assert settings.max_logprobs == 5 and not settings.log_requests and settings.uvicorn_log_level == "info"
    assert settings.served_model_names == ("m",) and settings.api_key == "k"


def test_kv_cache_memory_bytes_is_kv_cache_memory(captured, llama_path):
    assert cli.main(["serve", llama_path, "--kv-cache-memory-bytes", "8MiB"]) == 0
    by_vllm_name = captured["config"]
    assert cli.main(["serve", llama_path, "--kv-cache-memory", "8MiB"]) == 0
    assert captured["config"] == by_vllm_name


@pytest.mark.parametrize("flags, says", [
    (["--gpu-memory-utilization", "0.9"], "--kv-cache-memory"),
    (["--tensor-parallel-size", "2"], "--data-parallel-size"),
    (["-tp", "4"], "--data-parallel-size"),
    (["--pipeline-parallel-size", "2"], "--data-parallel-size"),
    (["--no-enable-chunked-prefill"], "--max-num-batched-tokens"),
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--dtype", "half"], "bfloat16"),
    (["--quantization", "awq"], "GGUF"),
    (["--generation-config", "auto"], "per request"),
    (["--max-logprobs", "100"], "at most 20"),
    (["--kv-cache-dtype", "fp8"], "--dtype"),
    (["--enable-lora"], "LoRA"),
    (["--chat-template", "no-such-file"], "neither a file nor a jinja2 template"),
])
def test_vllm_flags_without_a_kvsentry_meaning_are_refused_naming_the_equivalent(captured, llama_path, capsys,
                                                                                 flags, says):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", llama_path, *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and flags[0] in err, err
    assert "config" not in captured


def test_model_flag_and_positional_model_must_agree(captured, llama_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", llama_path, "--model", "/elsewhere"])
    assert "disagree" in capsys.readouterr().err
    assert cli.main(["serve", llama_path, "--model", llama_path]) == 0
