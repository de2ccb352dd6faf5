"""Test-side tools for the null-block hazard: the old broken dummy batch, rebuilt from the
engine's public pieces, and bitwise views of a KV cache.

Production code has no switch for either. The broken batch is a ModelRunner subclass that
takes the real builder's dummy batch, swaps in a zero slot mapping and makes the activations
NaN with a standard forward hook on the token embedding.
"""
from __future__ import annotations

import contextlib
import hashlib
from unittest import mock

import torch

from engine.config import EngineConfig
from engine.engine_core import engine_core
from engine.engine_core.engine_core import EngineCore
from engine.worker.kv_cache import layer_tensors
from engine.worker.model_runner import ModelRunner


@contextlib.contextmanager
def nan_embeddings(model: torch.nn.Module):
    """Within the block every forward's token embeddings are NaN: uninitialised activations."""
    def to_nan(module, args, output: torch.Tensor) -> torch.Tensor:  # output [num_tokens, hidden]
        return torch.full_like(output, float("nan"))

    handle = model.get_input_embeddings().register_forward_hook(to_nan)
    try:
        yield
    finally:
        handle.remove()


class LegacyDummyRunner(ModelRunner):
    """Runs every dummy batch the way the old engine did: slots read from a zero-initialised
    buffer that was never refilled (every dummy token writes slot 0, in the null block), and
    garbage activations. Real batches are untouched."""

    def run_dummy(self, num_padded: int) -> torch.Tensor:  # [num_padded] int64, all slot 0
        batch = self.builder.build_dummy(num_padded)
        batch.meta.slot_mapping = torch.zeros_like(batch.meta.slot_mapping)
        with nan_embeddings(self.model):
            self.forward(batch)
        return batch.meta.slot_mapping


class LegacyDummyCore(EngineCore):
    """An EngineCore whose runner is a LegacyDummyRunner."""

    def __init__(self, config: EngineConfig):
        with mock.patch.object(engine_core, "ModelRunner", LegacyDummyRunner):
            super().__init__(config)


def cache_digest(kv_caches) -> str:
    """Hash of every byte of the cache: equal digests mean a bitwise unchanged cache."""
    digest = hashlib.blake2b(digest_size=16)
    for entry in kv_caches:
        for t in layer_tensors(entry):
            digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def null_block_nonzero(kv_caches) -> int:
    """Non-zero bytes in block 0 (the null block) of every layer."""
    return sum(int(t[0].contiguous().view(torch.uint8).count_nonzero())
               for entry in kv_caches for t in layer_tensors(entry))
