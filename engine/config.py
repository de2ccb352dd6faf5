"""One validated, immutable engine configuration, built once and passed down.

`EngineConfig.create(model=..., **engine_args)` is the only constructor the rest
of the code uses; nothing rewrites a config after it is built.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.placement import check_device_name, check_placement, visible_cuda_devices
from engine.gguf.hf_config import eos_token_ids, hf_config_from_gguf
from engine.placement import resolve_dtype
from engine.gguf.reader import is_gguf_path, read_gguf
from engine.spec_decode.config import SpeculativeConfig, parse_speculative_config

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
NAN_SENTINEL_MODES = ("off", "null-block", "rolling", "full")  # what the KV cache scan covers
NAN_POLICIES = ("count", "heal", "fail")  # what a NaN (or a checksum mismatch) found in the cache triggers
KV_CHECKSUM_MODES = ("off", "rolling", "full")  # which sealed blocks are re-verified each step
SCHEDULING_POLICIES = ("fcfs", "priority")  # the order requests are admitted and preempted in
# How a GGUF checkpoint's quantized linears multiply on CPU (engine/models/int8_linear.py): "int8"
# quantizes the activations per block of 32 and multiplies with the weights' own blocks, "none"
# keeps the exact dequantized weights, "auto" is "int8" where the CPU has AVX512-VNNI or AVX-VNNI, but
# for Q4_1 and Q8_0 where bf16 runs on AMX tiles and every layer is of those types.
QUANTIZED_ACTIVATIONS = ("auto", "int8", "none")
DEFAULT_MAX_MODEL_LEN_CAP = 4096  # max_model_len when none is given: the model's limit, at most this

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype: unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def parse_memory(value: int | float | str) -> int:
    """'4GiB', '512MiB', '2G', '1e9' or a number of bytes -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", value)
    if not match:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} (try '2GiB' or a byte count)")
    try:
        number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    except ValueError:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} (try '2GiB' or a byte count)") from None
    scale = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(number * scale)


def default_pad_buckets(max_tokens: int) -> tuple[int, ...]:
    """Step sizes a batch is padded up to, spaced like vLLM's CUDA-graph capture sizes:
    1, 2, 4, then every 8 up to 256, every 16 up to 1024, every 64 beyond. Padded tokens
    run through every layer (on CPU there is no graph to amortise them), so the spacing
    bounds the waste: at most 7 tokens up to 256, under 7% above."""
    buckets = [1, 2, 4, *range(8, 257, 8), *range(272, 1025, 16)]
    while buckets[-1] < max_tokens:
        buckets.append(buckets[-1] + 64)
    return tuple(buckets)


# The largest batch a decode CUDA graph is captured for (vLLM's cap); larger steps run eagerly.
MAX_CUDA_GRAPH_SIZE = 512


def default_cuda_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Decode batch sizes captured as CUDA graphs, vLLM's spacing: 1, 2, 4, every 8 up to
    256, every 16 up to MAX_CUDA_GRAPH_SIZE, through the first size that holds max_num_seqs
    decodes (so every decode step of a full batch replays a graph)."""
    candidates = [1, 2, 4, *range(8, 256, 8), *range(256, MAX_CUDA_GRAPH_SIZE + 1, 16)]
    largest = min(max_num_seqs, MAX_CUDA_GRAPH_SIZE)
    return tuple(s for s in candidates if s < largest) + (next(s for s in candidates if s >= largest),)


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a Hugging Face config.json the engine uses (for a GGUF file, the
    config.json its metadata describes)."""
    path: str
    architecture: str
    hf_config: dict[str, Any] = field(repr=False, compare=False, hash=False)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    # MLA (DeepSeek V2/V3): the cache holds one latent vector per token.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    num_experts: int = 0
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a turn (generation_config.json)
    tokenizer: str = ""  # a tokenizer directory or .gguf file; the model path unless overridden

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.hf_config.get(key, default)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str | torch.dtype = "float32",
                        tokenizer: str | os.PathLike | None = None) -> "ModelConfig":
        root = Path(path)
        if is_gguf_path(root):
            gguf = read_gguf(root)
            hf, eos_ids, source = hf_config_from_gguf(gguf), eos_token_ids(gguf), root
        else:
            hf, eos_ids, source = _read_config_json(root)
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r} in {source}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf["num_attention_heads"]
        kv_lora_rank = hf.get("kv_lora_rank") or 0 if arch.startswith("Deepseek") else 0
        num_experts = (hf.get("num_local_experts") or hf.get("num_experts")
                       or hf.get("n_routed_experts") or 0) if arch in MOE_ARCHITECTURES else 0
        if kv_lora_rank:
            head_dim = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
            num_kv_heads = 1
        else:
            head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
            num_kv_heads = hf.get("num_key_value_heads") or num_heads
        return cls(
            path=str(root), architecture=arch, hf_config=hf, eos_token_ids=eos_ids,
            tokenizer=str(tokenizer if tokenizer is not None else root),
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=parse_dtype(dtype), kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=hf.get("qk_rope_head_dim", 0) if kv_lora_rank else 0,
            num_experts=num_experts,
        )

    def kv_bytes_per_token_per_layer(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        if self.is_mla:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * elem
        return 2 * self.num_kv_heads * self.head_dim * elem


def _read_config_json(root: Path) -> tuple[dict[str, Any], tuple[int, ...], Path]:
    """config.json, the end-of-turn ids (generation_config.json wins) and the file read."""
    config_file = root / "config.json"
    if not root.is_dir():
        raise FileNotFoundError(f"model directory not found: {root}")
    if not config_file.is_file():
        raise FileNotFoundError(f"model directory {root} has no config.json")
    hf = json.loads(config_file.read_text())
    generation_file = root / "generation_config.json"
    eos = json.loads(generation_file.read_text()).get("eos_token_id") if generation_file.is_file() else None
    eos = hf.get("eos_token_id") if eos is None else eos
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return hf, eos_ids, config_file


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_size_local: int = 1
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    # Dummy-batch inputs: token 0 everywhere, or random ids that spread tokens over experts.
    dummy_batch_random_inputs: bool = False

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size: must be >= 1")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError("data_parallel_rank: must be in [0, data_parallel_size)")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_blocks: int = 0  # derived from kv_cache_memory unless given
    enable_prefix_caching: bool = True
    device: str = "cpu"
    seed: int = 0
    # Token counts a step is padded up to (like CUDA-graph capture sizes).
    pad_buckets: tuple[int, ...] = ()
    nan_sentinel: str = "rolling"  # one of NAN_SENTINEL_MODES
    # Rolling mode: the sweep scans what nan_scan_budget (a share of wall time) pays for, at most
    # nan_scan_blocks_per_step blocks a step; budget 0: exactly nan_scan_blocks_per_step. A cold
    # block of the default model costs ~0.1 ms; the null block is scanned besides (below).
    nan_scan_budget: float = 0.003
    nan_scan_blocks_per_step: int = 16
    nan_scan_written_blocks: bool = False  # rolling mode: also scan every block the step wrote
    # Rolling and null-block modes: the whole null block is scanned every this many steps, and in
    # any step whose KV writer counted a write into it (why not every step on CPU: the docstring
    # of engine/integrity/sentinel.py). 0: auto (4 on CPU, 1 on CUDA).
    nan_scan_null_every: int = 0
    nan_policy: str = "count"  # one of NAN_POLICIES
    kv_checksums: str = "rolling"  # one of KV_CHECKSUM_MODES
    kv_checksum_blocks_per_step: int = 16  # rolling mode: blocks the verification sweep visits per step
    strict_kv_writes: bool = False  # the KV writer refuses (skips) writes outside the step's blocks
    num_threads: int = 0  # torch threads per rank; 0 = cores / local ranks
    # Decode batch sizes captured as CUDA graphs (engine/worker/cuda_graphs.py), ascending;
    # none given: default_cuda_graph_sizes(max_num_seqs). Only on CUDA, never with enforce_eager.
    cuda_graph_sizes: tuple[int, ...] = ()
    enforce_eager: bool = False  # no CUDA graphs, no fused CPU layer stack: every op runs from Python
    cuda_graph_check_null_block: bool = False  # debug: verify block 0 is zero after every dummy replay
    scheduling_policy: str = "fcfs"  # one of SCHEDULING_POLICIES (engine/core/request_queue.py)
    # priority policy: a request's effective priority improves by one level every this many
    # scheduler steps it has spent on the rank, which bounds starvation; 0: no aging.
    priority_aging_steps: int = 256
    # Prompt-lookup speculative decoding (engine/spec_decode/); None: off.
    speculative_config: SpeculativeConfig | None = None
    # Rank supervision (engine/dp/supervision.py): more rank deaths than this within the window
    # (seconds) is a crash loop -- the server stops respawning and reports itself unhealthy.
    max_rank_restarts: int = 5
    rank_restart_window: float = 300.0
    # Structured outputs (engine/structured/limits.py, engine/structured/compile_pool.py): a spec
    # over a size bound is refused before it compiles; a compile runs on worker threads, never on
    # the step loop, and a request whose grammar is not ready within the timeout is refused.
    structured_outputs_compile_timeout: float = 10.0  # seconds from arrival at the rank
    structured_outputs_compile_workers: int = 2  # compile threads per rank
    max_structured_outputs_spec_bytes: int = 65536  # the spec (schema, regex, grammar, tools) as UTF-8
    max_structured_outputs_choices: int = 4096  # entries of a choice list or of any one JSON schema enum
    max_structured_outputs_depth: int = 128  # JSON nesting of a schema (each object and array is a level)
    dtype_reason: str = ""  # why model.dtype: "asked for", or what --dtype auto saw (engine/placement.py)
    # "auto": int8 where its kernel runs (AVX512-VNNI or AVX-VNNI), as llama.cpp multiplies, within the
    # perplexity bound (+0.33% float32, +0.42% bf16 on the default model); the exact Q4_1 / Q8_0
    # weights where bf16 runs on AMX tiles and the layers are those types, faster than int8 from 16 rows up
    # (int8_linear.int8_formats).
    quantized_activations: str = "auto"  # one of QUANTIZED_ACTIVATIONS

    @property
    def lockstep(self) -> bool:
        """MoE at DP > 1 steps in lockstep (engine/dp/rank.py): every MoE layer is a collective,
        so a rank never runs a forward alone."""
        return self.parallel.data_parallel_size > 1 and self.model.is_moe

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def padded_num_tokens(self, num_tokens: int) -> int:
        for bucket in self.pad_buckets:
            if num_tokens <= bucket:
                return bucket
        return num_tokens

    @classmethod
    def create(cls, model: str, *, tokenizer: str | None = None, dtype: str = "auto",
               kv_cache_memory: int | str = "1GiB",
               num_gpu_blocks: int | None = None, max_model_len: int | None = None,
               data_parallel_size: int = 1, data_parallel_rank: int = 0,
               data_parallel_size_local: int | None = None, data_parallel_start_rank: int = 0,
               data_parallel_address: str = "127.0.0.1", data_parallel_rpc_port: int = 29550,
               dummy_batch_random_inputs: bool = False,
               **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)} - {"model", "parallel", "num_blocks"}
        for key in kwargs:
            if key not in known:
                raise ValueError(f"{key}: unknown engine argument")
        dtype, kwargs["dtype_reason"] = resolve_dtype(dtype, kwargs.get("device", cls.device))
        model_config = ModelConfig.from_pretrained(model, dtype, tokenizer)
        limit = model_config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
        if not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len: must be in [1, {limit}] for this model, got {max_model_len}")
        block_size = kwargs.get("block_size", cls.block_size)
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {block_size}")
        max_num_batched_tokens = kwargs.get("max_num_batched_tokens", cls.max_num_batched_tokens)
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be >= 1")
        if kwargs.get("max_num_seqs", cls.max_num_seqs) < 1:
            raise ValueError("max_num_seqs: must be >= 1")
        if not 0.0 <= kwargs.get("nan_scan_budget", cls.nan_scan_budget) < 1.0:
            raise ValueError("nan_scan_budget: must be a share of time in [0, 1)")
        if kwargs.get("nan_sentinel", cls.nan_sentinel) not in NAN_SENTINEL_MODES:
            raise ValueError(f"nan_sentinel: must be one of {', '.join(NAN_SENTINEL_MODES)}")
        if kwargs.get("nan_scan_null_every", cls.nan_scan_null_every) < 0:
            raise ValueError("nan_scan_null_every: must be >= 0 (0: auto)")
        if kwargs.get("nan_policy", cls.nan_policy) not in NAN_POLICIES:
            raise ValueError(f"nan_policy: must be one of {', '.join(NAN_POLICIES)}")
        if kwargs.get("kv_checksums", cls.kv_checksums) not in KV_CHECKSUM_MODES:
            raise ValueError(f"kv_checksums: must be one of {', '.join(KV_CHECKSUM_MODES)}")
        if kwargs.get("quantized_activations", cls.quantized_activations) not in QUANTIZED_ACTIVATIONS:
            raise ValueError(f"quantized_activations: must be one of {', '.join(QUANTIZED_ACTIVATIONS)}")
        if kwargs.get("kv_checksum_blocks_per_step", cls.kv_checksum_blocks_per_step) < 1:
            raise ValueError("kv_checksum_blocks_per_step: must be >= 1")
        if kwargs.get("scheduling_policy", cls.scheduling_policy) not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be one of {', '.join(SCHEDULING_POLICIES)}")
        if kwargs.get("priority_aging_steps", cls.priority_aging_steps) < 0:
            raise ValueError("priority_aging_steps: must be >= 0 (0: no aging)")
        if kwargs.get("max_rank_restarts", cls.max_rank_restarts) < 0:
            raise ValueError("max_rank_restarts: must be >= 0")
        if kwargs.get("rank_restart_window", cls.rank_restart_window) <= 0:
            raise ValueError("rank_restart_window: must be > 0 seconds")
        if not kwargs.get("structured_outputs_compile_timeout", cls.structured_outputs_compile_timeout) > 0:
            raise ValueError("structured_outputs_compile_timeout: must be > 0 seconds")
        for name in ("structured_outputs_compile_workers", "max_structured_outputs_spec_bytes",
                     "max_structured_outputs_choices", "max_structured_outputs_depth"):
            if kwargs.get(name, getattr(cls, name)) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if num_gpu_blocks is None:
            per_block = (model_config.kv_bytes_per_token_per_layer() * block_size
                         * model_config.num_layers)
            num_gpu_blocks = parse_memory(kv_cache_memory) // per_block
        if num_gpu_blocks < 2:
            raise ValueError("kv_cache_memory: budget leaves fewer than 2 KV blocks "
                             "(block 0 is reserved as the null block)")
        sizes = tuple(kwargs.get("cuda_graph_sizes") or ())
        if any(not isinstance(size, int) or size < 1 for size in sizes):
            raise ValueError(f"cuda_graph_sizes: every size must be a positive integer, got {sizes}")
        kwargs["cuda_graph_sizes"] = (tuple(sorted(set(sizes))) if sizes
                                      else default_cuda_graph_sizes(kwargs.get("max_num_seqs", cls.max_num_seqs)))
        kwargs["speculative_config"] = parse_speculative_config(kwargs.get("speculative_config"))
        if "pad_buckets" not in kwargs:
            kwargs["pad_buckets"] = default_pad_buckets(max_num_batched_tokens)
        local = data_parallel_size_local if data_parallel_size_local is not None else data_parallel_size
        device = kwargs.get("device", cls.device)
        check_device_name(device)
        if device != "cpu":  # the ranks this node runs, one GPU each: refused here, before any starts
            check_placement(device, local, visible_cuda_devices())
        parallel = ParallelConfig(
            data_parallel_size=data_parallel_size, data_parallel_rank=data_parallel_rank,
            data_parallel_size_local=local, data_parallel_start_rank=data_parallel_start_rank,
            data_parallel_address=data_parallel_address, data_parallel_rpc_port=data_parallel_rpc_port,
            dummy_batch_random_inputs=dummy_batch_random_inputs)
        return cls(model=model_config, parallel=parallel, max_model_len=max_model_len,
                   num_blocks=num_gpu_blocks, **kwargs)

    def for_rank(self, rank: int) -> "EngineConfig":
        """The same configuration as seen by DP rank `rank` (a new object, not a mutation)."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, data_parallel_rank=rank))
