"""Operator fault injection (behind --enable-fault-injection): poison the cache on purpose
(NaN, Inf, or one flipped bit in a sealed block), or run the next dummy batch the old
broken way (slots in the null block, NaN activations) or with a stale slot buffer, to test
detection and alerting end to end."""
from __future__ import annotations

import torch

from engine.messages import Fault
from engine.worker.batch_builder import BatchBuilder, StepBatch
from engine.worker.kv_cache import layer_tensors


def inject(runner, fault: Fault, checksums=None) -> None:
    if fault.kind in ("legacy_dummy", "stale_slot_dummy"):
        broken = LegacyDummyOnce if fault.kind == "legacy_dummy" else StaleSlotDummyOnce
        if not isinstance(runner.builder, BrokenDummyOnce):  # armed twice: still one batch
            runner.builder = broken(runner)
        return
    if fault.kind not in ("nan", "inf", "bitflip"):
        raise ValueError(f"kind: unknown fault {fault.kind!r} (nan, inf, bitflip, legacy_dummy, stale_slot_dummy)")
    if not 0 <= fault.layer < len(runner.kv_caches):
        raise ValueError(f"layer: must be in [0, {len(runner.kv_caches)})")
    if fault.kind == "bitflip":
        flip_bit(checksums, fault)
        return
    tensors = layer_tensors(runner.kv_caches[fault.layer])
    if not 0 <= fault.block < tensors[0].shape[0]:
        raise ValueError(f"block: must be in [0, {tensors[0].shape[0]})")
    which = {"k": 0, "latent": 0, "v": len(tensors) - 1}.get(fault.target)
    if which is None:
        raise ValueError("target: must be k, v or latent")
    block = tensors[which][fault.block]
    block[(0,) * block.dim()] = float("nan") if fault.kind == "nan" else float("inf")


class BrokenDummyOnce:
    """Stands in for the runner's batch builder until the next dummy batch, builds that one
    broken (`break_batch`), then hands the real builder back. Made from public pieces -- the
    real builder's safe dummy batch, then one change to it -- so that neither the builder nor
    any model carries a switch for it."""

    def __init__(self, runner):
        self.runner = runner
        self.builder: BatchBuilder = runner.builder

    def __getattr__(self, name: str):
        return getattr(self.builder, name)  # real batches are the real builder's

    def build_dummy(self, num_padded: int) -> StepBatch:
        stale = self.builder.slot_mapping[:num_padded].clone()  # [num_padded] as the last step left it
        if not self.ready(stale):
            return self.builder.build_dummy(num_padded)
        self.runner.builder = self.builder  # one shot
        batch = self.builder.build_dummy(num_padded)
        self.break_batch(batch, stale)
        return batch

    def ready(self, stale: torch.Tensor) -> bool:
        return True

    def break_batch(self, batch: StepBatch, stale: torch.Tensor) -> None:
        raise NotImplementedError


class LegacyDummyOnce(BrokenDummyOnce):
    """The old dummy batch read its slots from a zero-initialised buffer that was never refilled,
    so every dummy token wrote slot 0, inside the null block, and its activations were
    whatever the buffers held (here NaN: a one-shot forward hook on the token embedding)."""

    def break_batch(self, batch: StepBatch, stale: torch.Tensor) -> None:
        # A fresh tensor, not the builder's persistent buffer: only this batch is broken.
        batch.meta.slot_mapping = torch.zeros_like(batch.meta.slot_mapping)  # [num_padded], all slot 0
        nan_activations_once(self.runner.model)


def nan_activations_once(model: torch.nn.Module) -> None:
    """The next forward's token embeddings come out NaN (garbage activations), once."""
    def to_nan(module, args, output: torch.Tensor) -> torch.Tensor:  # output [num_tokens, hidden]
        handle.remove()
        return torch.full_like(output, float("nan"))

    handle = model.get_input_embeddings().register_forward_hook(to_nan)


class StaleSlotDummyOnce(BrokenDummyOnce):
    """A dummy batch built with the slot buffer the previous real step left behind instead of
    refilling it with PAD_SLOT_ID: the dummy's finite keys and values land in blocks that
    belong to other requests. No NaN appears; the foreign-write counter (and, in a sealed
    block, the checksum sweep) must catch it."""

    def ready(self, stale: torch.Tensor) -> bool:
        # A dummy batch that already refilled the buffer since the last real step leaves nothing
        # stale: stay armed until a real step leaves its slots behind again.
        return bool((stale >= 0).any())

    def break_batch(self, batch: StepBatch, stale: torch.Tensor) -> None:
        batch.meta.slot_mapping = stale.to(batch.meta.slot_mapping.device)


def stale_dummy_tokens(runner) -> int:
    """Tokens a replayed stale dummy batch needs to cover every slot the buffer still holds."""
    return max(1, int((runner.builder.slot_mapping >= 0).sum()))


def flip_bit(checksums, fault: Fault) -> None:
    """Flip the lowest bit of the first word of (layer, block, target): a finite change."""
    block = checksums.latest_sealed if fault.block == -1 else fault.block
    if block is None or not checksums.enabled:
        raise ValueError("block: this rank has no sealed block to flip a bit in (or --kv-checksums off)")
    if not 0 <= block < checksums.num_blocks or not checksums.sealed[block]:
        raise ValueError(f"block: {block} is not a sealed block")
    words = checksums.words[block, fault.layer]  # [chunks, words] int32
    chunk = {"k": 0, "latent": 0, "v": words.shape[0] // 2}.get(fault.target)
    if chunk is None:
        raise ValueError("target: must be k, v or latent")
    words[chunk, 0] ^= 1
