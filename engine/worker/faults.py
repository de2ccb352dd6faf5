"""Operator fault injection (behind --enable-fault-injection): poison the cache on purpose,
or make the next dummy batch use the old broken slot mapping, to test alerting end to end."""
from __future__ import annotations

from engine.worker.kv_cache import layer_tensors
from engine.messages import Fault


def inject(runner, fault: Fault) -> None:
    if fault.kind == "legacy_dummy":
        runner.builder.legacy_next_dummy = True
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
