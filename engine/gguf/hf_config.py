"""GGUF metadata -> the Hugging Face config.json dict the engine's models read.

llama.cpp writes hyper-parameters as `{arch}.{key}`; each supported architecture maps onto
one transformers architecture. What the metadata leaves out is derived from the tensors
(tied embeddings, biases, which layers are sparse, per-expert sizes).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from engine.gguf.reader import GGUFFile

F32_TYPE = 0  # GGMLQuantizationType.F32


def _uniform(gguf: GGUFFile, key: str, default: Any = None) -> Any:
    """`{arch}.{key}`; llama.cpp writes a per-layer list for hybrid models, one value here."""
    value = gguf.arch_get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"{gguf.path}: per-layer {gguf.architecture}.{key} {value} is not supported")
        value = value[0]
    return value


def _common(gguf: GGUFFile) -> dict[str, Any]:
    hidden = gguf.arch_get("embedding_length")
    num_heads = _uniform(gguf, "attention.head_count")
    embed = gguf.tensors.get("token_embd.weight")
    if hidden is None or num_heads is None or embed is None:
        raise ValueError(f"{gguf.path}: GGUF lacks {gguf.architecture}.embedding_length, "
                         ".attention.head_count or token_embd.weight")
    head_dim = gguf.arch_get("attention.key_length") or hidden // num_heads
    hf: dict[str, Any] = {
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "intermediate_size": _uniform(gguf, "feed_forward_length", 0),
        "num_hidden_layers": gguf.arch_get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _uniform(gguf, "attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": gguf.arch_get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": gguf.arch_get("rope.freq_base", 10000.0),
        "max_position_embeddings": gguf.arch_get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in gguf.tensors,
        "hidden_act": "silu",
    }
    rope_scaling = _rope_scaling(gguf)
    if rope_scaling:
        hf["rope_scaling"] = rope_scaling
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in gguf.metadata:
            hf[name] = gguf.metadata[f"tokenizer.ggml.{key}"]
    return hf


def _rope_scaling(gguf: GGUFFile) -> dict[str, Any] | None:
    linear = gguf.arch_get("rope.scale_linear")  # the older spelling of a linear factor
    kind = gguf.arch_get("rope.scaling.type", "linear" if linear else "none")
    factor = gguf.arch_get("rope.scaling.factor", linear or 1.0)
    original = gguf.arch_get("rope.scaling.original_context_length")
    if "rope_freqs.weight" in gguf.tensors:
        return _llama3_rope_scaling(gguf)
    if kind in ("none", "") or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        if original:
            scaling["original_max_position_embeddings"] = original
        return scaling
    raise ValueError(f"{gguf.path}: rope scaling type {kind!r} is not supported (linear, yarn, llama3 are)")


def _llama3_rope_scaling(gguf: GGUFFile, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                         original: int = 8192) -> dict[str, Any]:
    """llama.cpp stores Llama-3.1-style rope scaling only as per-frequency divisors
    (`rope_freqs`). Every released Llama 3.x uses low/high frequency factors 1 and 4 over an
    8192-token original context; the divisors are checked against that rule, not trusted."""
    info = gguf.tensors["rope_freqs.weight"]
    if info.ggml_type != F32_TYPE:
        raise ValueError(f"{gguf.path}: rope_freqs.weight must be F32")
    count = int(np.prod(info.shape))
    divisors = np.frombuffer(gguf.raw_bytes(info, 4 * count), dtype="<f4").astype(np.float64)
    factor = float(divisors.max())
    dim = 2 * count
    base = gguf.arch_get("rope.freq_base", 10000.0)
    expected = []
    for i in range(count):
        wavelen = 2 * math.pi * base ** (2 * i / dim)
        if wavelen < original / high_freq_factor:
            expected.append(1.0)
        elif wavelen > original / low_freq_factor:
            expected.append(factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if not np.allclose(divisors, expected, rtol=1e-4):
        raise ValueError(f"{gguf.path}: rope_freqs does not follow Llama 3's rope scaling rule; "
                         "this rope scaling is not supported")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor, "original_max_position_embeddings": original}


def _layers_with(gguf: GGUFFile, suffix: str, num_layers: int) -> list[int]:
    return [i for i in range(num_layers) if f"blk.{i}.{suffix}" in gguf.tensors]


def _expert_sizes(gguf: GGUFFile, hf: dict[str, Any]) -> list[int]:
    """Routed-expert fields shared by the MoE architectures (sizes fall back to tensor
    shapes); returns the sparse layers, those with a router."""
    layers = _layers_with(gguf, "ffn_gate_inp.weight", hf["num_hidden_layers"])
    if not layers:
        raise ValueError(f"{gguf.path}: a {gguf.architecture} GGUF without any ffn_gate_inp tensor")
    first = layers[0]
    hf["num_experts_per_tok"] = gguf.arch_get("expert_used_count")
    hf["moe_intermediate_size"] = (gguf.arch_get("expert_feed_forward_length")
                                   or gguf.tensors[f"blk.{first}.ffn_up_exps.weight"].shape[1])
    return layers


def _dense(architecture: str) -> Callable[[GGUFFile], dict[str, Any]]:
    def build(gguf: GGUFFile) -> dict[str, Any]:
        hf = _common(gguf)
        rope_dim = gguf.arch_get("rope.dimension_count")
        if rope_dim is not None and rope_dim != hf["head_dim"]:
            raise ValueError(f"{gguf.path}: partial rotary (rope.dimension_count {rope_dim} < head_dim "
                             f"{hf['head_dim']}) is not supported")
        if architecture == "LlamaForCausalLM" and gguf.arch_get("expert_count", 0):
            return _mixtral(gguf, hf)
        hf["architectures"] = [architecture]
        hf["model_type"] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                            "Qwen3ForCausalLM": "qwen3"}[architecture]
        return hf
    return build


def _mixtral(gguf: GGUFFile, hf: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp writes Mixtral as `llama` with experts."""
    hf.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
              num_local_experts=gguf.arch_get("expert_count"))
    _expert_sizes(gguf, hf)
    hf["intermediate_size"] = hf.pop("moe_intermediate_size")
    return hf


def _qwen_moe(architecture: str) -> Callable[[GGUFFile], dict[str, Any]]:
    def build(gguf: GGUFFile) -> dict[str, Any]:
        hf = _common(gguf)
        hf.update(architectures=[architecture], num_experts=gguf.arch_get("expert_count"),
                  decoder_sparse_step=1)
        sparse = _expert_sizes(gguf, hf)
        hf["mlp_only_layers"] = [i for i in range(hf["num_hidden_layers"]) if i not in sparse]
        if architecture == "Qwen2MoeForCausalLM":
            hf.update(model_type="qwen2_moe", norm_topk_prob=False, qkv_bias=hf["attention_bias"])
            shared = gguf.tensors.get(f"blk.{sparse[0]}.ffn_up_shexp.weight")
            hf["shared_expert_intermediate_size"] = (gguf.arch_get("expert_shared_feed_forward_length")
                                                     or (shared.shape[0] if shared else 0))
        else:
            # llama.cpp renormalises Qwen3-MoE's top-k weights (transformers' GGUF loader says the same).
            hf.update(model_type="qwen3_moe", norm_topk_prob=True)
        return hf
    return build


def _deepseek2(gguf: GGUFFile) -> dict[str, Any]:
    """DeepSeek-V2/V3 (MLA + MoE). llama.cpp stores MLA as one "KV head" of size
    kv_lora_rank + rope; the per-head sizes sit in key_length_mla / value_length_mla
    (older files: key_length / value_length)."""
    hf = _common(gguf)
    rope_dim = gguf.arch_get("rope.dimension_count")
    key_mla = gguf.arch_get("attention.key_length_mla") or gguf.arch_get("attention.key_length")
    value_mla = gguf.arch_get("attention.value_length_mla") or gguf.arch_get("attention.value_length")
    sigmoid = gguf.arch_get("expert_gating_func", 1) == 2
    n_group = gguf.arch_get("expert_group_count", 1) or 1
    hf.update(
        architectures=["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if sigmoid else "deepseek_v2",
        num_key_value_heads=hf["num_attention_heads"],
        q_lora_rank=gguf.arch_get("attention.q_lora_rank"),
        kv_lora_rank=gguf.arch_get("attention.kv_lora_rank"),
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=key_mla - rope_dim, v_head_dim=value_mla,
        n_routed_experts=gguf.arch_get("expert_count"),
        n_shared_experts=gguf.arch_get("expert_shared_count", 0),
        first_k_dense_replace=gguf.arch_get("leading_dense_block_count", 0),
        routed_scaling_factor=gguf.arch_get("expert_weights_scale", 1.0),
        norm_topk_prob=bool(gguf.arch_get("expert_weights_norm", False)),
        n_group=n_group, topk_group=gguf.arch_get("expert_group_used_count", n_group) or n_group,
    )
    del hf["head_dim"]
    _expert_sizes(gguf, hf)
    if sigmoid:
        hf.update(topk_method="noaux_tc", rope_interleave=True)
    else:
        hf["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
    log_mul = gguf.arch_get("rope.scaling.yarn_log_multiplier")
    if "rope_scaling" in hf and log_mul:
        # llama.cpp keeps 0.1 * mscale_all_dim; DeepSeek's configs set mscale equal to it.
        hf["rope_scaling"].update(mscale=log_mul / 0.1, mscale_all_dim=log_mul / 0.1)
    return hf


# general.architecture -> builder of the transformers config dict.
_BUILDERS: dict[str, Callable[[GGUFFile], dict[str, Any]]] = {
    "llama": _dense("LlamaForCausalLM"),
    "qwen2": _dense("Qwen2ForCausalLM"),
    "qwen3": _dense("Qwen3ForCausalLM"),
    "qwen2moe": _qwen_moe("Qwen2MoeForCausalLM"),
    "qwen3moe": _qwen_moe("Qwen3MoeForCausalLM"),
    "deepseek2": _deepseek2,
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(_BUILDERS)


def hf_config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    arch = gguf.architecture
    if arch not in _BUILDERS:
        raise ValueError(f"{gguf.path}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    return _BUILDERS[arch](gguf)


def eos_token_ids(gguf: GGUFFile) -> tuple[int, ...]:
    """Every id that ends a turn: llama.cpp's end-of-sequence, end-of-turn and end-of-message."""
    ids = [gguf.metadata.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return tuple(dict.fromkeys(i for i in ids if i is not None))
