"""config.json of each architecture the demo writer knows: tiny defaults, the
structure-changing fields, RoPE written both ways."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from service.demo.tokenizer import MIN_VOCAB_SIZE, BOS_ID, EOS_ID

@dataclass(frozen=True)
class Arch:
    model_type: str
    family: str            # "gqa" or "mla"
    moe: str | None        # None, "mixtral", "qwen2_moe", "qwen3_moe", "deepseek"
    defaults: dict
    derive_head_dim: bool = True  # head_dim follows hidden_size // num_attention_heads


_COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "use_cache": True,
}
_QWEN_NO_SLIDING = {"use_sliding_window": False, "sliding_window": None}
_MLA = {
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 2,
    "topk_group": 1,
    "attention_bias": False,
}

ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": Arch("llama", "gqa", None, {
        "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}),
    "Qwen2ForCausalLM": Arch("qwen2", "gqa", None, dict(_QWEN_NO_SLIDING)),
    "Qwen3ForCausalLM": Arch("qwen3", "gqa", None, {
        "head_dim": 32, "attention_bias": False, **_QWEN_NO_SLIDING}, derive_head_dim=False),
    "MixtralForCausalLM": Arch("mixtral", "gqa", "mixtral", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None}),
    "Qwen2MoeForCausalLM": Arch("qwen2_moe", "gqa", "qwen2_moe", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": False, "qkv_bias": True, "router_aux_loss_coef": 0.001,
        **_QWEN_NO_SLIDING}),
    "Qwen3MoeForCausalLM": Arch("qwen3_moe", "gqa", "qwen3_moe", {
        "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "attention_bias": False, "router_aux_loss_coef": 0.001, **_QWEN_NO_SLIDING},
        derive_head_dim=False),
    "DeepseekV2ForCausalLM": Arch("deepseek_v2", "mla", "deepseek", {
        **_MLA, "topk_method": "group_limited_greedy", "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.5, "mlp_bias": False}),
    "DeepseekV3ForCausalLM": Arch("deepseek_v3", "mla", "deepseek", {
        **_MLA, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rope_interleave": True, "num_nextn_predict_layers": 0}),
}

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_config(architecture: str) -> dict:
    """The tiny default config.json dict for `architecture`, before overrides."""
    arch = arch_of(architecture)
    return {**copy.deepcopy(_COMMON), **copy.deepcopy(arch.defaults)}


def arch_of(architecture: str) -> Arch:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"choose one of {sorted(ARCHITECTURES)}") from None


def _rope_parameters(cfg: dict, overrides: dict) -> dict:
    """Fold rope_theta / rope_scaling / rope_parameters overrides into one rope_parameters dict."""
    params: dict[str, Any] = {"rope_type": "default"}
    scaling = overrides.get("rope_parameters") or overrides.get("rope_scaling") or {}
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:  # legacy spelling
        scaling["rope_type"] = scaling.pop("type")
    params.update(scaling)
    params.setdefault("rope_theta", float(cfg["rope_theta"]))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    if params["rope_type"] != "default" and "factor" not in params:
        raise ValueError(f"rope_type {params['rope_type']!r} needs a 'factor'")
    if params["rope_type"] == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"llama3 rope scaling needs {key!r}")
    return params


def build_config(architecture: str = "LlamaForCausalLM", *, init_scale: float = 0.02,
                 dtype: str = "float32", **config_overrides) -> dict:
    """The full config.json dict (overrides applied, derived fields filled, validated)."""
    arch = arch_of(architecture)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    overrides = copy.deepcopy(config_overrides)
    cfg = default_config(architecture)
    rope_keys = {"rope_scaling", "rope_parameters"}
    cfg.update({k: v for k, v in overrides.items() if k not in rope_keys})
    if "rope_parameters" in overrides and "rope_theta" in (overrides["rope_parameters"] or {}) \
            and "rope_theta" not in overrides:
        cfg["rope_theta"] = float(overrides["rope_parameters"]["rope_theta"])

    if arch.family == "mla":
        if "num_key_value_heads" not in overrides:  # MLA: one latent, every head reads it
            cfg["num_key_value_heads"] = cfg["num_attention_heads"]
        cfg.pop("head_dim", None)  # transformers derives it (= qk_rope_head_dim)
    elif arch.derive_head_dim and "head_dim" not in overrides:
        if cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ValueError("hidden_size must be divisible by num_attention_heads "
                             "(or pass head_dim explicitly)")
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg["vocab_size"] < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}")
    if arch.moe == "deepseek":
        n_exp, n_group = cfg["n_routed_experts"], cfg.get("n_group") or 1
        if n_exp % n_group:
            raise ValueError("n_routed_experts must be divisible by n_group")
        if cfg["num_experts_per_tok"] > n_exp:
            raise ValueError("num_experts_per_tok > n_routed_experts")
        if cfg.get("topk_method") == "noaux_tc" and n_exp // n_group < 2:
            raise ValueError("noaux_tc scores a group by its top-2 experts: "
                             "need >= 2 experts per group")
        if (cfg.get("moe_layer_freq") or 1) != 1:
            raise ValueError("moe_layer_freq != 1 is not supported by transformers' DeepSeek models")
        if architecture == "DeepseekV2ForCausalLM" and cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ValueError("transformers requires hidden_size % num_attention_heads == 0 for V2")
    if arch.model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        cfg.setdefault("max_window_layers", cfg["num_hidden_layers"])

    rope = _rope_parameters(cfg, overrides)
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_parameters"] = rope
    legacy = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else legacy

    cfg.update({
        "architectures": [architecture],
        "model_type": arch.model_type,
        "initializer_range": init_scale,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
        "torch_dtype": dtype,
        "dtype": dtype,
    })
    return dict(sorted(cfg.items()))
