"""The engine arguments a command line may set: every `EngineConfig.create` keyword a user
picks, with its help text, in one place.

No default is written here: `EngineArg.default` reads it from create()'s signature or,
for the keywords create() passes through, from the EngineConfig field, so `kvsentry serve
--help` and the flags' defaults cannot drift from what the config does without them.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.spec_decode.config import parse_speculative_config
from engine.config import (DEFAULT_MAX_MODEL_LEN_CAP, KV_CHECKSUM_MODES, NAN_POLICIES, NAN_SENTINEL_MODES,
                           QUANTIZED_ACTIVATIONS, EngineConfig)
from engine.config import SCHEDULING_POLICIES


def config_default(name: str) -> Any:
    """The value EngineConfig.create uses for keyword `name` when it is not given."""
    parameter = inspect.signature(EngineConfig.create).parameters.get(name)
    if parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY:
        return parameter.default
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    if name not in fields or fields[name].default is dataclasses.MISSING:
        raise KeyError(f"{name}: not an EngineConfig.create keyword with a default")
    return fields[name].default


@dataclass(frozen=True)
class EngineArg:
    name: str                                  # the EngineConfig.create keyword (the flag's dest)
    help: str                                  # what it does; front ends add the default
    group: str = "engine"                      # the section of --help it belongs in
    flag: str = ""                             # when not --<name with dashes>
    type: Callable[[str], Any] | None = None   # parses the flag's value; None: the default's type
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()              # other spellings (vLLM's), same meaning

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def options(self) -> tuple[str, ...]:
        return (self.option, *self.aliases)

    @property
    def default(self) -> Any:
        return config_default(self.name)


def parse_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4,8' (or '1 2 4 8') -> (1, 2, 4, 8)."""
    try:
        return tuple(int(part) for part in text.replace(",", " ").split())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def parse_dtype(text: str) -> str:
    """--dtype in kvsentry's names, vLLM's 'float' (float32) included."""
    if text in ("half", "float16"):
        raise argparse.ArgumentTypeError(f"{text} is not supported: use bfloat16 (or float32)")
    return {"float": "float32"}.get(text, text)


def _speculative_config(text: str):
    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


ENGINE_ARGS = (
    EngineArg("tokenizer", "tokenizer directory (tokenizer.json) or .gguf file to use instead of the model's "
              "own (none given: the model's)", type=str),
    EngineArg("max_model_len", "longest prompt + completion in tokens (none given: the model's limit, "
              f"at most {DEFAULT_MAX_MODEL_LEN_CAP})", type=int),
    EngineArg("block_size", "tokens per KV cache block (a power of two)"),
    EngineArg("max_num_seqs", "most requests per batch per rank"),
    EngineArg("max_num_batched_tokens", "token budget of one step per rank; longer prompts are prefilled in chunks"),
    EngineArg("kv_cache_memory", "KV cache budget per rank, e.g. 4GiB or 512MiB", aliases=("--kv-cache-memory-bytes",)),
    EngineArg("num_gpu_blocks", "number of KV cache blocks per rank; overrides --kv-cache-memory", type=int),
    EngineArg("dtype", "weights and activations dtype (auto, as vLLM: bfloat16 on a CPU with native bf16, AMX or AVX512-BF16, "
              "else float32; float32 is the exact path; vLLM's 'float' is float32; float16 is not "
              "supported, use bfloat16)", type=parse_dtype, choices=("auto", "float32", "bfloat16")),
    EngineArg("device", "where the ranks run: cpu, cuda (local rank l on cuda:l of the visible GPUs) or "
              "cuda:N (one local rank only)", type=str),
    EngineArg("enable_prefix_caching", "reuse KV blocks of identical prompt prefixes"),
    EngineArg("seed", "seed of requests that give none"),
    EngineArg("num_threads", "torch threads per rank (0: CPU cores / local ranks)", flag="--threads"),
    EngineArg("data_parallel_size", "DP ranks in the whole group", group="data parallel", aliases=("-dp",)),
    EngineArg("data_parallel_size_local", "DP ranks this node runs (none given: all of them)",
              group="data parallel", type=int),
    EngineArg("data_parallel_start_rank", "first DP rank this node runs (worker nodes of a multi-node group)",
              group="data parallel"),
    EngineArg("data_parallel_address", "address of the node running the front end, where ranks connect",
              group="data parallel"),
    EngineArg("data_parallel_rpc_port", "first of 3 consecutive TCP ports for requests, outputs and the rank "
              "rendezvous", group="data parallel"),
    EngineArg("dummy_batch_random_inputs", "dummy batches feed random token ids, spreading their tokens over "
              "the experts as real traffic does, instead of token 0 everywhere", group="data parallel"),
    EngineArg("nan_sentinel", "what the KV cache scan covers each step", group="NaN sentinel",
              choices=NAN_SENTINEL_MODES),
    EngineArg("nan_scan_budget", "rolling mode: share of wall time the sweep may spend scanning (0: a fixed "
              "--nan-scan-blocks-per-step window every step); the null block is scanned besides",
              group="NaN sentinel"),
    EngineArg("nan_scan_null_every", "rolling and null-block modes: the null block is scanned every N steps, and "
              "in any step whose KV writer wrote into it (0: auto, 4 on CPU and 1 on CUDA)",
              group="NaN sentinel"),
    EngineArg("nan_scan_blocks_per_step", "blocks the rolling scan checks per step (the most, under a budget)",
              group="NaN sentinel"),
    EngineArg("nan_scan_written_blocks", "rolling mode: also scan every block the step wrote", group="NaN sentinel"),
    EngineArg("nan_policy", "on NaN/Inf in the cache: only count it, heal the block and fail the requests "
              "reading it, or fail and mark the server not ready", group="NaN sentinel", choices=NAN_POLICIES),
    EngineArg("kv_checksums", "sealed KV blocks (full, then only read) get a checksum; which of them are "
              "re-verified each step (a mismatch is finite corruption; --nan-policy says what follows)",
              group="KV integrity", choices=KV_CHECKSUM_MODES),
    EngineArg("kv_checksum_blocks_per_step", "rolling mode: blocks the verification sweep visits per step",
              group="KV integrity"),
    EngineArg("strict_kv_writes", "refuse (skip) cache writes outside the blocks the step's requests own, "
              "instead of only counting them", group="KV integrity"),
    EngineArg("cuda_graph_sizes", "decode batch sizes captured as CUDA graphs, e.g. 1,2,4,8 (none given: 1, 2, 4, "
              "every 8 up to 256, every 16 beyond, through --max-num-seqs, at most 512); a decode step pads "
              "to the next size", group="CUDA graphs", type=parse_sizes),
    EngineArg("enforce_eager", "never capture CUDA graphs, nor run a CPU model's layers as one op "
              "(engine/models/fused_stack.py): every op of every step runs from Python", group="CUDA graphs"),
    EngineArg("cuda_graph_check_null_block", "debug: after every dummy batch replayed through a CUDA graph, "
              "verify the null block is bitwise zero on every layer (one host sync) and stop if not",
              group="CUDA graphs"),
    EngineArg("scheduling_policy", "order of admission and preemption on each rank: fcfs (arrival), or "
              "priority (the request's `priority`, lower first, then arrival; the lowest is preempted first)",
              group="scheduling", choices=SCHEDULING_POLICIES),
    EngineArg("priority_aging_steps", "priority policy: a waiting request's effective priority improves by one "
              "level every N scheduler steps, so a request of priority p is never overtaken by one of priority q "
              "arriving more than (p - q) * N steps after it (0: no aging)", group="scheduling"),
    EngineArg("speculative_config", 'speculative decoding as vLLM\'s JSON, prompt lookup only: {"method": "ngram", '
              '"num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M} (none given: off)',
              group="speculative decoding", type=_speculative_config),
    EngineArg("max_rank_restarts", "a dead DP rank is respawned (lockstep groups re-form); more deaths than "
              "this within --rank-restart-window is a crash loop: no more respawns, /health turns 503",
              group="data parallel"),
    EngineArg("rank_restart_window", "seconds over which --max-rank-restarts counts rank deaths",
              group="data parallel"),
    EngineArg("structured_outputs_compile_timeout", "seconds a request may wait for its grammar to compile "
              "(from its arrival at the rank); past it the request is a 400 naming the field",
              group="structured outputs"),
    EngineArg("structured_outputs_compile_workers", "grammar compile threads per rank (compiles never run on the "
              "step loop)", group="structured outputs"),
    EngineArg("max_structured_outputs_spec_bytes", "largest structured-output spec (JSON schema, regex, grammar, "
              "structural tag, tool schemas) in UTF-8 bytes; larger is a 400", group="structured outputs"),
    EngineArg("max_structured_outputs_choices", "most entries of a choice list, or of any one enum of a JSON "
              "schema; more is a 400", group="structured outputs"),
    EngineArg("max_structured_outputs_depth", "deepest nesting of objects and arrays in a JSON schema or "
              "structural tag; deeper is a 400", group="structured outputs"),
    EngineArg("quantized_activations", "GGUF checkpoints on CPU: int8 quantizes each linear's activations per "
              "block of 32 and multiplies them with the weights' own Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K blocks "
              "(llama.cpp's arithmetic; AVX512-VNNI, AMX-INT8, AVX-VNNI); none keeps the exact dequantized weights "
              "(token-identical to transformers in float32); auto is int8 on CPUs with AVX512-VNNI or AVX-VNNI, except "
              "Q4_1/Q8_0 where bf16 runs on AMX tiles (faster there from 16 rows up)", choices=QUANTIZED_ACTIVATIONS),
)
