"""`kvsentry` command line: `serve` (the HTTP service) and `generate` (offline, one prompt)."""
from __future__ import annotations

import argparse
import os
import sys

from engine import envs

DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # also ServeSettings' default; kept here so --help imports nothing heavy


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default when it has a real one (never the API key's value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and action.dest != "api_key" and "%(default)" not in text
                and action.default not in (None, False, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="serve a model over the OpenAI-compatible HTTP API",
        description="Serve MODEL_DIR (a Hugging Face checkpoint directory) over HTTP. Without MODEL_DIR, "
                    "the built-in demo model (tiny-deepseek-v3, DP=2) is written once into "
                    "$KVSENTRY_CACHE_DIR (default ~/.cache/kvsentry) and served.",
        formatter_class=_HelpFormatter)
    serve.add_argument("model", nargs="?", metavar="MODEL_DIR",
                       help="checkpoint directory (config.json, safetensors, tokenizer.json); "
                            "default: the built-in demo")
    http = serve.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    http.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    http.add_argument("--served-model-name", nargs="+", default=None,
                      help="name(s) clients use in the `model` field; the first is reported in responses "
                           "(default: MODEL_DIR as given, or the demo preset name)")
    http.add_argument("--api-key", default=envs.api_key(),
                      help="require 'Authorization: Bearer KEY' on the API routes (/health, /ready, "
                           "/metrics and /version stay open); default: $KVSENTRY_API_KEY")
    http.add_argument("--max-queued-requests", type=int, default=512,
                      help="engine requests in flight before new ones get 503 + Retry-After")
    http.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                      help="larger request bodies get 413")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="on SIGTERM, seconds in-flight requests may take before they are aborted")
    http.add_argument("--health-stall-timeout", type=float, default=60.0,
                      help="/health turns 503 when no engine step completed for this many seconds "
                           "while requests are in flight (a wedged rank)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                      help="log level of the JSON-lines log on stderr")
    http.add_argument("--log-prompts", action="store_true",
                      help="include prompt text in the per-request log line (off: only token counts)")
    http.add_argument("--enable-fault-injection", action="store_true",
                      help="enable POST /debug/faults (poison the KV cache on purpose, to test alerting)")

    engine = serve.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion in tokens (default: the model's limit, at most 4096)")
    engine.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block (power of two; default 16)")
    engine.add_argument("--max-num-seqs", type=int, default=None, help="most requests per batch per rank (default 64)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one step per rank; longer prompts are prefilled in chunks (default 2048)")
    engine.add_argument("--kv-cache-memory", default=None,
                        help="KV cache budget per rank, e.g. 4GiB or 512MiB (default 1GiB)")
    engine.add_argument("--num-gpu-blocks", type=int, default=None,
                        help="number of KV cache blocks per rank; overrides --kv-cache-memory")
    engine.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=None,
                        help="weights and activations dtype (auto = float32)")
    engine.add_argument("--device", choices=["cpu", "cuda"], default=None, help="where the ranks run (default cpu)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse KV blocks of identical prompt prefixes (default on)")
    engine.add_argument("--seed", type=int, default=None, help="seed of requests that give none (default 0)")
    engine.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: CPU cores / local ranks)")

    parallel = serve.add_argument_group("data parallel")
    parallel.add_argument("--data-parallel-size", type=int, default=None,
                          help="DP ranks in the whole group (default 1; 2 for the built-in demo)")
    parallel.add_argument("--data-parallel-size-local", type=int, default=None,
                          help="DP ranks this node runs (default: all of them)")
    parallel.add_argument("--data-parallel-start-rank", type=int, default=None,
                          help="first DP rank this node runs (worker nodes of a multi-node group)")
    parallel.add_argument("--data-parallel-address", default=None,
                          help="address of the node running the front end, where ranks connect (default 127.0.0.1)")
    parallel.add_argument("--data-parallel-rpc-port", type=int, default=None,
                          help="first of 3 consecutive TCP ports for requests, outputs and the rank "
                               "rendezvous (default 29550)")
    parallel.add_argument("--headless", action="store_true",
                          help="run only this node's ranks, no HTTP server (worker nodes)")

    nan = serve.add_argument_group("NaN sentinel")
    nan.add_argument("--nan-sentinel", choices=["off", "null-block", "rolling", "full"], default=None,
                     help="what the KV cache scan covers each step (default rolling)")
    nan.add_argument("--nan-scan-blocks-per-step", type=int, default=None,
                     help="blocks the rolling scan checks per step (default 64)")
    nan.add_argument("--nan-policy", choices=["count", "heal", "fail"], default=None,
                     help="on NaN/Inf in the cache: only count it, heal the block and fail the requests "
                          "reading it, or fail and mark the server not ready (default count)")


_ENGINE_ARGS = {  # CLI dest -> EngineConfig.create argument
    "dtype": "dtype", "kv_cache_memory": "kv_cache_memory", "num_gpu_blocks": "num_gpu_blocks",
    "max_model_len": "max_model_len", "block_size": "block_size", "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens", "enable_prefix_caching": "enable_prefix_caching",
    "device": "device", "seed": "seed", "nan_sentinel": "nan_sentinel",
    "nan_scan_blocks_per_step": "nan_scan_blocks_per_step", "nan_policy": "nan_policy",
    "threads": "num_threads", "data_parallel_size": "data_parallel_size",
    "data_parallel_size_local": "data_parallel_size_local",
    "data_parallel_start_rank": "data_parallel_start_rank",
    "data_parallel_address": "data_parallel_address", "data_parallel_rpc_port": "data_parallel_rpc_port",
}


def engine_args(args: argparse.Namespace) -> dict:
    return {key: getattr(args, dest) for dest, key in _ENGINE_ARGS.items() if getattr(args, dest) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsentry", description="kvsentry: a dummy-run-safe LLM inference server. "
                                     "Run `kvsentry serve --help` for the server's flags.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="serve: the HTTP server; generate: one offline completion")
    _add_serve_parser(sub)
    gen = sub.add_parser("generate", help="offline generation for one prompt (no server)")
    gen.add_argument("model", nargs="?", help="HF checkpoint directory (default: the built-in demo)")
    gen.add_argument("--prompt", default="Hello, my name is", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    return parser


def serve(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from service.demo import DEFAULT_DEMO_DP, DEFAULT_DEMO_PRESET, default_demo_path
    from service.logs import setup_logging
    from service.state import ServeSettings

    setup_logging(args.log_level)
    if args.model is None:
        model_path, default_name = str(default_demo_path()), DEFAULT_DEMO_PRESET
        if args.data_parallel_size is None:
            args.data_parallel_size = DEFAULT_DEMO_DP
    else:
        model_path = default_name = args.model
    try:
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
        log_prompts=args.log_prompts, enable_fault_injection=args.enable_fault_injection)
    return run(config, AsyncEngineClient(config), settings, args.host, args.port)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "generate":
        from engine import LLM, SamplingParams
        from service.demo import default_demo_path
        with LLM(args.model or str(default_demo_path())) as llm:
            out = llm.generate([args.prompt], SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
        print(out[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
