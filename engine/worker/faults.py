"""Operator fault injection (behind --enable-fault-injection): poison the cache on purpose,
or run the next dummy batch the old broken way, to test detection and alerting end to end."""
from __future__ import annotations

import torch

from engine.messages import Fault
from engine.worker.batch_builder import BatchBuilder, StepBatch
from engine.worker.kv_cache import layer_tensors


def inject(runner, fault: Fault) -> None:
    if fault.kind == "legacy_dummy":
        if not isinstance(runner.builder, LegacyDummyOnce):  # armed twice is still one broken batch
            runner.builder = LegacyDummyOnce(runner)
        return
    if fault.kind not in ("nan", "inf"):
        raise ValueError(f"kind: unknown fault {fault.kind!r} (nan, inf, legacy_dummy)")
    if not 0 <= fault.layer < len(runner.kv_caches):
        raise ValueError(f"layer: must be in [0, {len(runner.kv_caches)})")
    tensors = layer_tensors(runner.kv_caches[fault.layer])
    if not 0 <= fault.block < tensors[0].shape[0]:
        raise ValueError(f"block: must be in [0, {tensors[0].shape[0]})")
    which = {"k": 0, "latent": 0, "v": len(tensors) - 1}.get(fault.target)
    if which is None:
        raise ValueError("target: must be k, v or latent")
    block = tensors[which][fault.block]
    block[(0,) * block.dim()] = float("nan") if fault.kind == "nan" else float("inf")


class LegacyDummyOnce:
    """Stands in for the runner's batch builder until the next dummy batch, builds that one
    the way the old engine did, then hands the real builder back.

    The old dummy batch read its slots from a zero-initialised buffer that was never refilled,
    so every dummy token wrote slot 0, inside the null block, and its activations were
    whatever the buffers held (here NaN). It is made from the public pieces -- the real
    builder's safe dummy batch, a zero slot mapping, a one-shot forward hook on the token
    embedding -- so that neither the builder nor any model carries a switch for it.
    """

    def __init__(self, runner):
        self.runner = runner
        self.builder: BatchBuilder = runner.builder

    def __getattr__(self, name: str):
        return getattr(self.builder, name)  # real batches are the real builder's

    def build_dummy(self, num_padded: int) -> StepBatch:
        self.runner.builder = self.builder  # one shot
        batch = self.builder.build_dummy(num_padded)
        # A fresh tensor, not the builder's persistent buffer: only this batch is broken.
        batch.meta.slot_mapping = torch.zeros_like(batch.meta.slot_mapping)  # [num_padded], all slot 0
        nan_activations_once(self.runner.model)
        return batch


def nan_activations_once(model: torch.nn.Module) -> None:
    """The next forward's token embeddings come out NaN (garbage activations), once."""
    def to_nan(module, args, output: torch.Tensor) -> torch.Tensor:  # output [num_tokens, hidden]
        handle.remove()
        return torch.full_like(output, float("nan"))

    handle = model.get_input_embeddings().register_forward_hook(to_nan)
