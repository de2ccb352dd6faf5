"""Architecture name -> model constructor.

Each entry names the module and factory of one architecture; the module is imported on
first use, so serving a dense model never imports the MoE code, and no module registers
itself by being imported.
"""
from __future__ import annotations

import importlib
from typing import Callable

from torch import nn

from engine.config import SUPPORTED_ARCHITECTURES, EngineConfig

# architecture -> (module, factory taking an EngineConfig)
_FACTORIES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("engine.models.llama", "CausalLM"),
    "Qwen2ForCausalLM": ("engine.models.llama", "CausalLM"),
    "Qwen3ForCausalLM": ("engine.models.llama", "CausalLM"),
    "MixtralForCausalLM": ("engine.models.mixtral", "mixtral_for_causal_lm"),
    "Qwen2MoeForCausalLM": ("engine.models.qwen_moe", "qwen_moe_for_causal_lm"),
    "Qwen3MoeForCausalLM": ("engine.models.qwen_moe", "qwen_moe_for_causal_lm"),
    "DeepseekV2ForCausalLM": ("engine.models.deepseek", "deepseek_for_causal_lm"),
    "DeepseekV3ForCausalLM": ("engine.models.deepseek", "deepseek_for_causal_lm"),
}
assert set(_FACTORIES) == set(SUPPORTED_ARCHITECTURES), "config and registry name different architectures"


def model_factory(architecture: str) -> Callable[[EngineConfig], nn.Module]:
    if architecture not in _FACTORIES:
        raise ValueError(f"architecture {architecture!r} has no model implementation")
    module, name = _FACTORIES[architecture]
    return getattr(importlib.import_module(module), name)


def build_model(config: EngineConfig) -> nn.Module:
    return model_factory(config.model.architecture)(config)
