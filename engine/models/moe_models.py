"""Registers the MoE architectures (imported by registry.build_model on first use)."""
from __future__ import annotations

from engine.models import registry
from engine.models.deepseek import deepseek_for_causal_lm
from engine.models.mixtral import mixtral_for_causal_lm
from engine.models.qwen_moe import qwen_moe_for_causal_lm

registry.register("MixtralForCausalLM", mixtral_for_causal_lm)
registry.register("Qwen2MoeForCausalLM", qwen_moe_for_causal_lm)
registry.register("Qwen3MoeForCausalLM", qwen_moe_for_causal_lm)
registry.register("DeepseekV2ForCausalLM", deepseek_for_causal_lm)
registry.register("DeepseekV3ForCausalLM", deepseek_for_causal_lm)
