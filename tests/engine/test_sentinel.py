"""The NaN sentinel finds poison within its promised bound and the policies act on it."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.ops import cpu_ops
from engine.engine_core.engine_core import EngineCore
from engine.paging import PAD_SLOT_ID, slots_for_positions
from engine.worker.batch_builder import BatchBuilder
from engine.worker.kv_cache import layer_tensors
from engine.messages import EngineRequest, Fault
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_core(path: str, **kwargs) -> EngineCore:
    args = dict(max_model_len=256, block_size=8, num_gpu_blocks=40, nan_scan_blocks_per_step=4, nan_scan_budget=0.0)
    args.update(kwargs)
    return EngineCore(EngineConfig.create(path, **{"dtype": "float32", **args}))


def nan_values(core: EngineCore) -> dict[tuple[int, str], int]:
    return {(layer, region): v for layer, region, v in core.stats().integrity.nan_values if v}


def drain(core: EngineCore) -> list:
    outs = []
    while core.has_unfinished:
        outs += core.step()
    return outs


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-deepseek-v3"])
def path(request, checkpoint):
    return checkpoint(request.param)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the csrc scan kernel on CPU
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_poison_found_within_coverage_bound(path, kind, dtype):
    core = make_core(path, dtype=dtype)
    assert core.integrity.sentinel.uses_kernel == (dtype == "bfloat16" and cpu_ops.available())
    bound = core.integrity.sentinel.coverage_steps
    assert bound == -(-39 // 4)
    rng = random.Random(kind)
    is_mla = core.config.model.is_mla
    for trial in range(6):
        layer = rng.randrange(core.config.model.num_layers)
        block = 0 if trial == 0 else rng.randrange(1, core.config.num_blocks)
        target = "latent" if is_mla else rng.choice(["k", "v"])
        core.inject_fault(Fault(kind, layer=layer, block=block, target=target))
        region = "null_block" if block == 0 else "allocated"
        for steps in range(1, bound + 1):
            core.run_dummy(4)
            if nan_values(core).get((layer, region)):
                break
        else:
            pytest.fail(f"{kind} in layer {layer} block {block} not found within {bound} steps")
        assert nan_values(core) == {(layer, region): 1}
        assert dict(core.stats().integrity.nan_detections)[region] >= 1
        core.integrity.sentinel.zero_block(block)  # clean up for the next trial
        core.run_dummy(1)
        core.run_dummy(1)
        for _ in range(bound):
            core.run_dummy(1)
        assert nan_values(core) == {}


def test_clean_traffic_reports_nothing(checkpoint):
    core = make_core(checkpoint("tiny-llama"), nan_sentinel="rolling")
    rng = random.Random(0)
    steps = 0
    while steps < 2000:
        if rng.random() < 0.2:
            core.add_request(EngineRequest(f"r{steps}", [rng.randrange(5, 500) for _ in range(rng.randrange(1, 30))],
                                           SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 20),
                                                          ignore_eos=True)))
        if core.has_unfinished and rng.random() < 0.7:
            core.step()
        else:
            core.run_dummy(rng.choice([1, 2, 4, 8]))
        steps += 1
    drain(core)
    stats = core.stats()
    assert all(v == 0 for _, _, v in stats.integrity.nan_values)
    assert dict(stats.integrity.nan_detections) == {"null_block": 0, "allocated": 0}
    assert stats.integrity.null_block_writes == 0 and stats.integrity.corrupted_requests == 0


def test_heal_aborts_owners_zeroes_block_and_forgets_prefix(checkpoint):
    core = make_core(checkpoint("tiny-llama"), nan_policy="heal", nan_sentinel="full")
    shared = list(range(20, 36))  # two full blocks of 8
    core.add_request(EngineRequest("a", shared + [40], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)))
    core.add_request(EngineRequest("b", [50, 51, 52], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)))
    core.step()
    victim_block = core.scheduler.requests["a#0"].block_ids[0]
    core.inject_fault(Fault("nan", layer=1, block=victim_block, target="v"))
    outs = core.step()
    errors = {o.request_id for o in outs if o.finish_reason == "error"}
    assert errors == {"a"}, "exactly the owner of the poisoned block is aborted"
    assert "b#0" in core.scheduler.requests, "other requests keep running"
    for entry in core.runner.kv_caches:
        for t in layer_tensors(entry):
            assert torch.count_nonzero(t[victim_block]) == 0
    assert core.integrity.heals >= 1 and core.integrity.corrupted_requests == 1
    # A later request with the same prefix must not reuse the poisoned block.
    core.add_request(EngineRequest("c", shared + [41], GREEDY))
    core.step()
    assert victim_block not in core.scheduler.requests["c#0"].block_ids[:1]
    drain(core)
    assert core.scheduler.kv.pool.num_free_blocks == core.config.num_blocks - 1


def test_heal_zeroes_poisoned_null_block(checkpoint):
    core = make_core(checkpoint("tiny-llama"), nan_policy="heal")
    core.inject_fault(Fault("legacy_dummy"))
    core.run_dummy(8)  # the old broken dummy batch: writes garbage into block 0
    assert core.stats().integrity.null_block_writes > 0
    assert core.integrity.heals == 1
    for entry in core.runner.kv_caches:
        for t in layer_tensors(entry):
            assert torch.count_nonzero(t[0]) == 0


def test_legacy_dummy_fault_breaks_exactly_the_next_dummy_batch(path):
    """The operator fault: real steps while it is armed are untouched, the next dummy batch
    writes garbage into block 0 of every layer, and the one after it writes nothing."""
    core = make_core(path, nan_sentinel="null-block")
    layers = core.config.model.num_layers
    core.inject_fault(Fault("legacy_dummy"))
    core.inject_fault(Fault("legacy_dummy"))  # armed twice: still one broken batch
    core.add_request(EngineRequest("a", [5, 6, 7], GREEDY))
    core.step()
    assert core.stats().integrity.null_block_writes == 0 and nan_values(core) == {}
    core.run_dummy(4)
    assert core.stats().integrity.null_block_writes == 4 * layers
    assert {region for _, region in nan_values(core)} == {"null_block"}
    assert type(core.runner.builder) is BatchBuilder  # the real builder is back
    core.integrity.sentinel.zero_block(0)
    core.run_dummy(4)
    assert core.stats().integrity.null_block_writes == 4 * layers
    assert nan_values(core) == {}
    outs = drain(core)
    assert outs[-1].finish_reason == "length"


def test_sentinel_is_given_the_slots_each_step_wrote(checkpoint, monkeypatch):
    """The runner returns what a step wrote and the core hands exactly that to the sentinel:
    a real step's token slots, a dummy batch's all-PAD_SLOT_ID mapping, nothing for an idle scan."""
    core = make_core(checkpoint("tiny-llama"))
    seen = []
    scan = core.integrity.sentinel.step
    monkeypatch.setattr(core.integrity.sentinel, "step", lambda slots, block_size: seen.append(slots) or scan(slots, block_size))
    core.add_request(EngineRequest("a", list(range(5, 15)), GREEDY))
    core.step()  # the prefill: positions 0..9
    blocks = np.asarray(core.scheduler.requests["a#0"].block_ids, dtype=np.int64)
    assert seen[-1].tolist() == slots_for_positions(blocks, np.arange(10), core.config.block_size).tolist()
    core.step()  # one decode token at position 10
    assert seen[-1].tolist() == slots_for_positions(blocks, np.arange(10, 11), core.config.block_size).tolist()
    core.run_dummy(4)
    assert seen[-1].shape == (4,) and bool((seen[-1] == PAD_SLOT_ID).all())
    core.idle_scan()
    assert seen[-1] is None


def test_fail_policy_trips_and_count_policy_does_not(checkpoint):
    for policy, tripped in (("fail", True), ("count", False)):
        core = make_core(checkpoint("tiny-llama"), nan_policy=policy)
        core.inject_fault(Fault("inf", layer=0, block=0, target="k"))
        for _ in range(core.integrity.sentinel.null_block_steps):  # a write from outside the KV writer
            core.run_dummy(1)
        assert core.stats().integrity.nan_policy_tripped is tripped
        assert nan_values(core) == {(0, "null_block"): 1}


def test_null_block_scanned_every_n_steps_and_whenever_the_writer_wrote_there(checkpoint):
    """The periodic null-block scan: poison put there from outside the KV writer is found on
    the N-th step and not before; a dummy batch whose writer wrote into block 0 is caught in
    that same step whatever the phase."""
    every = 8
    core = make_core(checkpoint("tiny-llama"), nan_sentinel="null-block", nan_scan_null_every=every)
    assert core.integrity.sentinel.null_block_steps == every and core.integrity.sentinel.coverage_steps == 0
    core.inject_fault(Fault("nan", layer=1, block=0, target="v"))
    for step in range(1, every + 1):
        core.run_dummy(2)
        assert bool(nan_values(core)) == (step == every), f"step {step}"
    assert nan_values(core) == {(1, "null_block"): 1}
    core.integrity.sentinel.zero_block(0)
    for _ in range(every):
        core.run_dummy(2)
    assert nan_values(core) == {}
    core.run_dummy(2)  # phase 1 of 8: not due on its own
    core.inject_fault(Fault("legacy_dummy"))
    core.run_dummy(4)
    assert core.stats().integrity.null_block_writes == 4 * core.config.model.num_layers
    assert {region for _, region in nan_values(core)} == {"null_block"}


def test_null_block_period_defaults_by_device_and_rejects_negatives(checkpoint):
    core = make_core(checkpoint("tiny-llama"))
    assert core.integrity.sentinel.null_block_steps == 4  # auto on CPU
    assert core.integrity.sentinel.coverage_steps == -(-39 // 4)
    assert make_core(checkpoint("tiny-llama"), nan_sentinel="full").integrity.sentinel.null_block_steps == 1
    assert make_core(checkpoint("tiny-llama"), nan_sentinel="off").integrity.sentinel.null_block_steps == 0
    with pytest.raises(ValueError, match="nan_scan_null_every"):
        EngineConfig.create(checkpoint("tiny-llama"), nan_scan_null_every=-1, dtype="float32")
