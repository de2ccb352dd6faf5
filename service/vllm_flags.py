"""vLLM's `serve` flags that users copy from its docs: accepted where kvsentry has the meaning,
refused with the kvsentry equivalent where it does not.

Flags vLLM and kvsentry share under one name (model, --served-model-name, --host, --port,
--api-key, --dtype, --max-model-len, --max-num-seqs, --max-num-batched-tokens, --block-size,
--seed, --tokenizer, --enable-prefix-caching, --enforce-eager, --data-parallel-size,
--tool-call-parser, --reasoning-parser) are kvsentry's own flags; this module adds the rest.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from engine.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class Refused:
    """A vLLM flag without a kvsentry meaning: giving it stops the command line with `equivalent`."""
    options: tuple[str, ...]
    equivalent: str
    switch: bool = False  # takes no value


REFUSED = (
    Refused(("--gpu-memory-utilization",), "kvsentry sizes the KV cache in bytes, not as a share of device "
            "memory: use --kv-cache-memory (e.g. 8GiB; vLLM's --kv-cache-memory-bytes is the same flag)"),
    Refused(("--cpu-offload-gb",), "kvsentry keeps every weight on the rank's device; no offload"),
    Refused(("--kv-cache-dtype",), "the KV cache holds the model's --dtype; there is no separate cache dtype"),
    Refused(("--enable-lora",), "kvsentry serves no LoRA adapters", switch=True),
)


class _Refuse(argparse.Action):
    def __init__(self, option_strings, dest, equivalent: str, **kwargs):
        self.equivalent = equivalent
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} (a vLLM flag) is not supported: {self.equivalent}")


def _no_more_than_one(option: str, equivalent: str):
    def parse(text: str) -> int:
        value = int(text)
        if value != 1:
            raise argparse.ArgumentTypeError(f"only 1 is supported ({option} is vLLM's): {equivalent}")
        return value
    return parse


def _max_logprobs(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"kvsentry returns at most {MAX_LOGPROBS} logprobs per token "
                                         f"(OpenAI's limit); give 0..{MAX_LOGPROBS}")
    return value


def _only(value: str, why: str):
    """An argparse type that takes `value` alone and refuses anything else, saying `why`."""
    def check(text: str) -> str:
        if text != value:
            raise argparse.ArgumentTypeError(why)
        return text
    return check


_generation_config = _only("vllm", "only 'vllm' is supported: kvsentry's sampling defaults are vLLM's own "
                                   "(temperature 1, top_p 1, ...) and it reads none from generation_config.json; "
                                   "send the checkpoint's values per request")
_quantization = _only("gguf", "kvsentry reads quantized weights from GGUF files (the .gguf's own types): serve "
                              "the .gguf file (--quantization gguf, or no flag)")


def read_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file holding the template, or the template itself."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a file name
        pass
    if "{{" in value or "{%" in value:
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a jinja2 template")


def add_vllm_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "vLLM command lines", "vLLM's serve flags: accepted with vLLM's meaning, or refused with the kvsentry "
        "equivalent")
    group.add_argument("--model", dest="model_flag", metavar="MODEL",
                       help="MODEL given as a flag (vLLM's older `api_server --model` form)")
    group.add_argument("--chat-template", type=read_chat_template, default=None,
                       help="chat template replacing the checkpoint's: a file, or the jinja2 text itself")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a chat request bring its own `chat_template` (a template is code the server "
                            "runs); without it such a request gets 400")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='accept tool_choice "auto" (needs --tool-call-parser, which already enables it)')
    group.add_argument("--max-logprobs", type=_max_logprobs, default=MAX_LOGPROBS,
                       help="most logprobs per token a request may ask for")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="log the per-request line at debug level, not info")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="accepted: the per-request line is logged unless --disable-log-requests")
    group.add_argument("--uvicorn-log-level", default=None,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="log level of the HTTP server (uvicorn)'s own messages")
    group.add_argument("--tensor-parallel-size", "-tp", type=_no_more_than_one(
        "--tensor-parallel-size", "kvsentry has no tensor parallelism; use --data-parallel-size N (one rank per "
        "device; a MoE model's experts are sharded over the ranks)"), default=1,
        help="accepted as 1 only (kvsentry has no tensor parallelism; see --data-parallel-size)")
    group.add_argument("--pipeline-parallel-size", "-pp", type=_no_more_than_one(
        "--pipeline-parallel-size", "kvsentry has no pipeline parallelism; use --data-parallel-size N"), default=1,
        help="accepted as 1 only (kvsentry has no pipeline parallelism; see --data-parallel-size)")
    group.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                       help="accepted: kvsentry always shards a MoE model's experts over its DP ranks")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="accepted on: prompts longer than --max-num-batched-tokens are always prefilled in "
                            "chunks (to prefill each prompt in one step, raise --max-num-batched-tokens)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted: kvsentry runs no code from a checkpoint (it loads the architectures it "
                            "implements), so there is nothing to trust")
    group.add_argument("--swap-space", type=float, default=None,
                       help="accepted, no effect: as in vLLM's V1 engine, a preempted request is recomputed, "
                            "nothing is swapped to CPU memory")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="accepted: kvsentry logs no periodic stats (they are on /metrics)")
    group.add_argument("--generation-config", type=_generation_config, default="vllm",
                       help="'vllm' only: the sampling defaults are vLLM's, none read from the checkpoint")
    group.add_argument("--quantization", "-q", type=_quantization, default=None,
                       help="'gguf' only: quantized weights come from a GGUF file's own types")
    for refused in REFUSED:
        group.add_argument(*refused.options, action=_Refuse, equivalent=refused.equivalent,
                           nargs=0 if refused.switch else None, help=f"refused: {refused.equivalent}")


def check_vllm_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The refusals that depend on more than one flag; `parser.error` exits 2 with the message."""
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            parser.error(f"serve: MODEL {args.model!r} and --model {args.model_flag!r} disagree; give one")
        args.model = args.model_flag
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes), as in vLLM")
    if not args.enable_chunked_prefill:
        parser.error("--no-enable-chunked-prefill is not supported: kvsentry always prefills a prompt longer than "
                     "--max-num-batched-tokens in chunks; raise --max-num-batched-tokens to at least "
                     "--max-model-len to prefill every prompt in one step")
