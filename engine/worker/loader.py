"""Load a Hugging Face checkpoint directory (sharded or not) into a model."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import EngineConfig
from engine.models.registry import build_model


def checkpoint_files(path: str | Path) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({root / name for name in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {root} has no *.safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"model directory {root} is missing weight file(s): {', '.join(missing)}")
    return files


def load_model(config: EngineConfig) -> nn.Module:
    """Build the model for this rank and fill it; only tensors the rank wants are read."""
    with torch.device(config.device):
        model = build_model(config)
    loaded: set[str] = set()
    for file in checkpoint_files(config.model.path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not model.wants_weight(name):
                    continue
                model.load_weight(name, f.get_tensor(name))
                loaded.add(name)
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"checkpoint {config.model.path} lacks weights: {', '.join(sorted(missing)[:8])}")
    model = model.to(config.model.dtype).eval()
    model.prepare_for_inference()
    return model
