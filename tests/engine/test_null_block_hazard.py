"""The hazard is real: a NaN in the null block corrupts real outputs, and the old
zero-initialised dummy slot buffer is exactly what puts it there."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_core.engine_core import EngineCore
from engine.worker.kv_cache import layer_tensors
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams
from tests.engine.cache_probe import LegacyDummyCore

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def run_pair(core: EngineCore) -> dict[str, tuple[list[int], list[float]]]:
    """A long and a short request decoded together: the short one's block-table row is
    padded with the null block up to the long one's length."""
    core.add_request(EngineRequest("long", list(range(10, 50)), PARAMS))
    core.add_request(EngineRequest("short", [11, 12, 13], PARAMS))
    result: dict[str, tuple[list[int], list[float]]] = {"long": ([], []), "short": ([], [])}
    while core.has_unfinished:
        for out in core.step():
            result[out.request_id][0].extend(out.new_token_ids)
            result[out.request_id][1].extend(lp.logprob for lp in out.new_logprobs or [])
    return result


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("tiny-llama")


def make_core(path: str, legacy_dummy: bool = False) -> EngineCore:
    config = EngineConfig.create(path, max_model_len=256, block_size=16, num_gpu_blocks=32, nan_sentinel="off", dtype="float32")
    return LegacyDummyCore(config) if legacy_dummy else EngineCore(config)


def poisoned(core: EngineCore) -> bool:
    return any(not torch.isfinite(t[0]).all() for e in core.runner.kv_caches for t in layer_tensors(e))


def test_nan_in_null_block_corrupts_padded_requests(path):
    clean = run_pair(make_core(path))
    core = make_core(path)
    for entry in core.runner.kv_caches:
        for t in layer_tensors(entry):
            t[0].fill_(float("nan"))
    dirty = run_pair(core)
    # The request whose padding reads block 0 is ruined (0 x NaN = NaN) ...
    assert any(math.isnan(v) for v in dirty["short"][1])
    assert dirty["short"] != clean["short"]
    assert core.integrity.corrupted_requests > 0
    # ... the one that never reads padding is untouched: it is the padding that spreads it.
    assert dirty["long"] == clean["long"]


@pytest.mark.parametrize("broken", [True, False])
def test_legacy_dummy_batch_writes_null_block(path, broken):
    """The old dummy batch (zero-initialised slot buffer, garbage activations; rebuilt by
    tests/engine/cache_probe.py) writes NaN into block 0 and poisons the next real requests;
    the safe builder writes nothing."""
    clean = run_pair(make_core(path))
    core = make_core(path, legacy_dummy=broken)
    before = [t.clone() for e in core.runner.kv_caches for t in layer_tensors(e)]
    for _ in range(3):
        core.run_dummy(8)
    after = [t.clone() for e in core.runner.kv_caches for t in layer_tensors(e)]
    writes = core.runner.null_block_writes.item()
    result = run_pair(core)
    if broken:
        assert writes == 3 * 8 * core.config.model.num_layers
        assert poisoned(core)
        assert any(math.isnan(v) for v in result["short"][1])
    else:
        assert writes == 0
        assert all(torch.equal(b.view(torch.int32), a.view(torch.int32)) for b, a in zip(before, after))
        assert not poisoned(core)
        assert result == clean
