"""Corruption that is not a NaN: sealed-block checksums find a flipped bit within their promised
bound with the right labels, the foreign-write counter counts a stale-slot dummy batch in the step
it runs, --strict-kv-writes refuses it, and the heal policy recomputes a corrupted prefix to the
same tokens as a clean run. Dense (llama) and MLA (deepseek) caches."""
from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_core.engine_core import EngineCore
from engine.messages import EngineRequest, Fault
from engine.sampling_params import SamplingParams
from engine.worker.kv_cache import layer_tensors
from tests.engine.dp_helpers import free_port_block, wait_stats

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_core(path: str, **kwargs) -> EngineCore:
    args = dict(max_model_len=256, block_size=BLOCK, num_gpu_blocks=40, kv_checksum_blocks_per_step=4)
    args.update(kwargs)
    return EngineCore(EngineConfig.create(path, **{"dtype": "float32", **args}))


def cache_bytes(core: EngineCore) -> list[torch.Tensor]:
    return [t.clone().view(torch.uint8) for entry in core.runner.kv_caches for t in layer_tensors(entry)]


def drain(core: EngineCore) -> list:
    outs = []
    while core.has_unfinished:
        outs += core.step()
    return outs


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(length)]


def mismatches(core: EngineCore) -> dict[str, int]:
    return {region: n for region, n in core.stats().integrity.checksum_mismatches if n}


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-deepseek-v3"])
def path(request, checkpoint):
    return checkpoint(request.param)


@pytest.mark.parametrize("prefix_caching, region", [(True, "prefix_cache"), (False, "running")])
def test_bit_flip_in_any_sealed_block_is_found_within_the_coverage_bound(path, prefix_caching, region):
    core = make_core(path, enable_prefix_caching=prefix_caching)
    layers = core.config.model.num_layers
    targets = ["latent"] if core.config.model.is_mla else ["k", "v"]
    rng = random.Random(0)
    for trial in range(6):
        # One long request keeps its sealed blocks alive (running) while others come and go.
        core.add_request(EngineRequest(f"keep{trial}", prompt(trial, 5 * BLOCK + 3),
                                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
        for _ in range(3):
            core.step()
        sealed = [b for b in core.scheduler.requests[f"keep{trial}#0"].block_ids if core.integrity.checksums.sealed[b]]
        assert sealed, "a running request with 5 full blocks has sealed blocks"
        block, layer, target = rng.choice(sealed), rng.randrange(layers), rng.choice(targets)
        before = mismatches(core).get(region, 0)
        core.inject_fault(Fault(kind="bitflip", layer=layer, block=block, target=target))
        for step in range(core.integrity.checksums.coverage_steps):
            core.step() if core.has_unfinished else core.idle_scan()
            if mismatches(core).get(region, 0) > before:
                break
        else:
            pytest.fail(f"flip in block {block} not found within {core.integrity.checksums.coverage_steps} steps")
        assert mismatches(core) == {region: before + 1}
        assert not core.integrity.checksums.sealed[block]  # reported once
        drain(core)
    stats = core.stats()
    assert stats.integrity.nan_detections == [("null_block", 0), ("allocated", 0)]  # finite corruption: no NaN
    assert stats.integrity.foreign_writes == 0


def test_the_flipped_layer_is_named(path, caplog):
    core = make_core(path, kv_checksums="full")
    core.add_request(EngineRequest("a", prompt(1, 3 * BLOCK), GREEDY))
    core.step()
    block = core.integrity.checksums.latest_sealed
    layer = core.config.model.num_layers - 1
    core.inject_fault(Fault(kind="bitflip", layer=layer, block=-1, target="latent" if core.config.model.is_mla else "v"))
    with caplog.at_level("WARNING"):
        core.step()
    assert f"KV block {block} (prefix_cache) changed after it was sealed, in layers [{layer}]" in caplog.text


def test_bit_flip_needs_a_sealed_block(path):
    core = make_core(path)
    with pytest.raises(ValueError, match="no sealed block"):
        core.inject_fault(Fault(kind="bitflip", block=-1))
    with pytest.raises(ValueError, match="not a sealed block"):
        core.inject_fault(Fault(kind="bitflip", block=3))


@pytest.mark.parametrize("strict", [False, True])
def test_stale_slot_dummy_is_a_foreign_write_in_the_step_it_runs(path, strict):
    core = make_core(path, kv_checksums="full", strict_kv_writes=strict)
    core.add_request(EngineRequest("a", prompt(2, 2 * BLOCK), GREEDY))  # prefill fills (seals) 2 blocks
    core.step()
    stale = int((core.runner.builder.slot_mapping >= 0).sum())
    assert stale == 2 * BLOCK and core.integrity.checksums.num_sealed == 2
    before = cache_bytes(core)
    core.inject_fault(Fault(kind="stale_slot_dummy"))  # DP=1: replayed at once
    stats = core.stats()
    assert stats.dummy_batches == 1
    assert stats.integrity.foreign_writes == stale  # once per token, in that step
    assert stats.integrity.nan_detections == [("null_block", 0), ("allocated", 0)]
    unchanged = all(torch.equal(x, y) for x, y in zip(before, cache_bytes(core)))
    if strict:
        assert unchanged and not mismatches(core)
    else:
        # The dummy's finite keys and values overwrote both sealed blocks: the sweep saw it.
        assert not unchanged and mismatches(core) == {"prefix_cache": 2}
    drain(core)
    assert core.stats().integrity.foreign_writes == stale  # real steps add nothing


def test_heal_recomputes_a_corrupted_prefix_to_the_clean_tokens(path):
    core = make_core(path, kv_checksums="full", nan_policy="heal")
    shared = prompt(3, 3 * BLOCK + 2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    core.add_request(EngineRequest("clean", shared, params))
    clean = [t for o in drain(core) for t in o.new_token_ids]
    core.add_request(EngineRequest("victim", shared, params))
    core.step()  # prefix hit on the cached blocks, which the victim now reads
    block = core.scheduler.requests["victim#0"].block_ids[1]
    block_hash = core.scheduler.kv.pool.block_hash[block]
    assert block_hash is not None and core.integrity.checksums.sealed[block]
    core.inject_fault(Fault(kind="bitflip", layer=0, block=block, target="latent" if core.config.model.is_mla else "k"))
    outs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finish_reason] == [("victim", "error")]
    assert core.scheduler.kv.pool.lookup(block_hash) is None  # left the prefix cache
    assert mismatches(core) == {"prefix_cache": 1} and core.stats().integrity.corrupted_requests == 1
    core.add_request(EngineRequest("again", shared, params))
    assert [t for o in drain(core) for t in o.new_token_ids] == clean


def wave_over(stats) -> bool:
    """Both ranks idle and at the same step count: the stats a rank sends as its wave ends."""
    return (len(stats) == 2 and all(s.num_running == s.num_waiting == 0 for s in stats.values())
            and len({s.steps for s in stats.values()}) == 1)


def test_dp2_lockstep_dummy_batches_write_nothing_foreign_until_a_stale_one_runs():
    # The MoE demo at DP=2 steps in lockstep: rank 1, idle, runs dummy batches while rank 0 works.
    # Clean: no foreign write, no mismatch on either rank with every sealed block verified every
    # step. Then rank 1's next dummy batch is armed with its stale slot buffer: counted there only.
    from engine.frontend.llm import LLM
    from service.demo import default_demo_path
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(model=str(default_demo_path()), num_threads=1, data_parallel_size=2, kv_checksums="full", dtype="float32",
             data_parallel_rpc_port=free_port_block(3)) as dp:
        dp.generate([prompt(4, 3 * BLOCK), prompt(5, 20)], [long, GREEDY], rank_of=[0, 1])
        wait_stats(dp.engine, wave_over, what="the wave's last stats")  # ranks report as a wave ends
        clean = dp.engine.stats
        assert clean[1].dummy_batches >= 20 and clean[0].integrity.sealed_blocks > 0
        assert [(s.integrity.foreign_writes, sum(n for _, n in s.integrity.checksum_mismatches)) for s in clean.values()] == [(0, 0)] * 2
        # Armed now; it fires on rank 1's first dummy batch after its next real step.
        dp.engine.inject_fault(1, Fault(kind="stale_slot_dummy"))
        steps = clean[0].steps
        dp.generate([prompt(6, 3 * BLOCK), prompt(7, 10)], [long, GREEDY], rank_of=[0, 1])
        wait_stats(dp.engine, lambda st: wave_over(st) and st[0].steps > steps, what="the wave's last stats")
        stats = dp.engine.stats
        assert stats[0].integrity.foreign_writes == 0 and stats[1].integrity.foreign_writes >= 1
        assert all(n == 0 for s in stats.values() for _, n in s.integrity.nan_detections)


def test_fail_policy_trips_on_a_mismatch(path):
    core = make_core(path, kv_checksums="full", nan_policy="fail")
    core.add_request(EngineRequest("a", prompt(8, 2 * BLOCK + 1), GREEDY))
    core.step()
    assert not core.stats().integrity.nan_policy_tripped
    core.inject_fault(Fault(kind="bitflip", block=-1, target="latent" if core.config.model.is_mla else "v"))
    core.step()
    assert core.stats().integrity.nan_policy_tripped  # the front end's /ready answers 503 from here on
