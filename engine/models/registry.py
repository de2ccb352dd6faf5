"""Architecture name -> model constructor."""
from __future__ import annotations

from typing import Callable

from torch import nn

from engine.config import EngineConfig


def _dense(config: EngineConfig) -> nn.Module:
    from engine.models.llama import CausalLM
    return CausalLM(config)


_REGISTRY: dict[str, Callable[[EngineConfig], nn.Module]] = {
    "LlamaForCausalLM": _dense,
    "Qwen2ForCausalLM": _dense,
    "Qwen3ForCausalLM": _dense,
}


def register(architecture: str, factory: Callable[[EngineConfig], nn.Module]) -> None:
    _REGISTRY[architecture] = factory


def build_model(config: EngineConfig) -> nn.Module:
    arch = config.model.architecture
    if arch not in _REGISTRY:
        # MoE models register themselves on import; importing here keeps the dense path light.
        import engine.models.moe_models  # noqa: F401
    if arch not in _REGISTRY:
        raise ValueError(f"architecture {arch!r} has no model implementation")
    return _REGISTRY[arch](config)
