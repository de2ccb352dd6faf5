"""Qwen2-MoE (qkv bias, gated shared expert) and Qwen3-MoE (per-head q/k RMSNorm, no shared expert).

A layer is sparse unless listed in `mlp_only_layers` or skipped by `decoder_sparse_step`;
dense layers use the ordinary `intermediate_size` MLP.
"""
from __future__ import annotations

from engine.config import EngineConfig, ModelConfig
from engine.models.expert_parallel import ExpertParallel
from engine.models.layers import SiluMLP
from engine.models.llama import DecoderLayer
from engine.models.moe import (GatedSharedExpertMoeBlock, MoECausalLM, SoftmaxTopKRouter,
                               SparseMoeBlock, StackedExperts)


def is_sparse_layer(mc: ModelConfig, layer_index: int) -> bool:
    """transformers' rule. The expert count comes from ModelConfig, which reads every alias:
    transformers 5 writes Qwen3-MoE's as `num_local_experts`, older files as `num_experts`."""
    return (layer_index not in (mc.get("mlp_only_layers") or [])
            and mc.num_experts > 0
            and (layer_index + 1) % (mc.get("decoder_sparse_step") or 1) == 0)


def make_qwen_moe_layer(config: EngineConfig, layer_index: int, ep: ExpertParallel) -> DecoderLayer:
    mc, hf = config.model, config.model.hf_config
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: only silu is supported, got {hf['hidden_act']!r}")
    if hf.get("use_sliding_window", False):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")
    if is_sparse_layer(mc, layer_index):
        gate = SoftmaxTopKRouter(mc.hidden_size, mc.num_experts, hf["num_experts_per_tok"],
                                 norm_topk_prob=bool(hf.get("norm_topk_prob", False)), round_to_model_dtype=True)
        experts = StackedExperts(mc.hidden_size, hf["moe_intermediate_size"], ep.expert_range(mc.num_experts))
        if mc.architecture == "Qwen2MoeForCausalLM":
            mlp = GatedSharedExpertMoeBlock(gate, experts, ep, mc.hidden_size,
                                            hf["shared_expert_intermediate_size"])
        else:
            mlp = SparseMoeBlock(gate, experts, ep)
    else:
        mlp = SiluMLP(mc.hidden_size, hf["intermediate_size"])
    return DecoderLayer(config, layer_index, mlp=mlp)


def qwen_moe_for_causal_lm(config: EngineConfig) -> MoECausalLM:
    """Qwen2MoeForCausalLM and Qwen3MoeForCausalLM."""
    return MoECausalLM(config, make_qwen_moe_layer)
