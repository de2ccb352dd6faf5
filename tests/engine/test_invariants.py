"""docs/design.md invariants 1-4 as properties over random request mixes and step sequences, with
the KV integrity counters (foreign writes, sealed-block checksum mismatches) at 0 throughout."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import engine.models.llama as llama_module
from engine.ops import cpu_ops
from engine.config import EngineConfig
from engine.paging import PAD_SLOT_ID
from engine.engine_core.engine_core import EngineCore
from engine.worker.kv_cache import layer_tensors
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams

BLOCK = 4


def cache_bits(core: EngineCore) -> list[torch.Tensor]:
    return [t.clone().view(torch.int32) for entry in core.runner.kv_caches for t in layer_tensors(entry)]


def assert_null_block_zero(core: EngineCore) -> None:
    for entry in core.runner.kv_caches:
        for t in layer_tensors(entry):
            assert torch.count_nonzero(t[0].view(torch.int32)) == 0, "null block written"


def record_kv_writes(monkeypatch) -> list[torch.Tensor]:
    """A list that gathers the real slots every KV write of a step targets (one entry per layer);
    the caller clears it between steps. Steps go through the Python layer loop or the fused stack
    (fused_stack.py, where every layer writes `slots`): both are recorded."""
    written: list[torch.Tensor] = []
    real_write, real_layers = llama_module.write_kv, cpu_ops.dense_decoder_layers

    def recording_write(key, value, k_cache, v_cache, slot_mapping, counter=None, **kwargs):
        written.append(slot_mapping[slot_mapping >= 0].clone())
        real_write(key, value, k_cache, v_cache, slot_mapping, counter, **kwargs)

    def recording_layers(*args):
        slots, k_caches = args[10], args[6]
        written.extend(slots[slots >= 0].clone() for _ in k_caches)
        return real_layers(*args)

    monkeypatch.setattr(llama_module, "write_kv", recording_write)
    monkeypatch.setattr(cpu_ops, "dense_decoder_layers", recording_layers)
    return written


def scheduled_slots(sched, block_size: int) -> set[int]:
    """The cache slots of every token the step computes: each scheduled request's next positions."""
    return {request.block_ids[pos // block_size] * block_size + pos % block_size
            for request, num_new in sched.scheduled
            for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_new)}


def changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    slots: set[int] = set()
    for b, a in zip(before, after):
        rows = (b != a).reshape(b.shape[0] * b.shape[1], -1).any(dim=1)
        slots |= set(torch.nonzero(rows).flatten().tolist())
    return slots


actions = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("dummy"), st.integers(1, 32), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
), min_size=1, max_size=30)


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("tiny-llama")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=actions, seed=st.integers(0, 2**16), prefix=st.booleans(), random_dummy=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_schedules_keep_invariants(path, plan, seed, prefix, random_dummy, policy, monkeypatch):
    # Under the priority policy requests get random priorities (aging every 3 steps): admission
    # and preemption then take requests from the middle of the arrival order.
    config = EngineConfig.create(path, max_model_len=128, block_size=BLOCK, num_gpu_blocks=24,
                                 max_num_batched_tokens=32, max_num_seqs=6, enable_prefix_caching=prefix,
                                 dummy_batch_random_inputs=random_dummy, kv_checksums="full",
                                 scheduling_policy=policy, priority_aging_steps=3, dtype="float32")
    core = EngineCore(config)
    written = record_kv_writes(monkeypatch)
    rng = random.Random(seed)
    ids = []
    # Shared stems so the prefix cache sees repeats.
    stems = [[rng.randrange(5, 500) for _ in range(12)] for _ in range(3)]

    def run_step() -> None:
        sched = core.schedule()
        expected = scheduled_slots(sched, BLOCK)
        before = cache_bits(core)
        written.clear()
        core.step(sched)
        # Invariant 4: the slots written are exactly those of the step's real tokens ...
        got = torch.cat(written).tolist() if written else []
        layers = config.model.num_layers
        assert sorted(got) == sorted(list(expected) * layers)
        assert changed_slots(before, cache_bits(core)) <= expected
        # ... and no stale slot survives anywhere past them in the persistent buffer.
        assert bool((core.runner.builder.slot_mapping[sched.num_tokens:] == PAD_SLOT_ID).all())
        assert not torch.any(core.runner.builder.block_tables[sched.num_reqs:])
        # Every full block of a live request carries a checksum.
        for request in core.scheduler.requests.values():
            full = request.block_ids[:request.num_computed_tokens // BLOCK]
            assert all(core.integrity.checksums.sealed[b] for b in full), "a full block was not sealed"

    for kind, a, b in plan:
        if kind == "add":
            prompt = (stems[a % 3][: a % 13] + [rng.randrange(5, 500) for _ in range(a)])[:a] or [7]
            rid = f"r{len(ids)}"
            ids.append(rid)
            n = 2 if a % 5 == 0 else 1  # n > 1: the samples share the prompt's blocks
            priority = rng.randrange(-2, 3) if policy == "priority" else 0
            core.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=b, ignore_eos=True, n=n,
                                                                        temperature=0.0 if n == 1 else 1.0),
                                           priority=priority))
        elif kind == "step":
            for _ in range(a):
                if core.has_unfinished:
                    run_step()
        elif kind == "dummy":
            # Invariant 2: a dummy batch leaves every byte of the cache unchanged.
            before = cache_bits(core)
            core.run_dummy(a)
            assert all(torch.equal(x, y) for x, y in zip(before, cache_bits(core)))
            assert bool((core.runner.builder.slot_mapping == PAD_SLOT_ID).all())
        elif kind == "abort" and ids:
            core.abort([ids[a % len(ids)]])
        assert_null_block_zero(core)  # invariant 1

    steps = 0
    while core.has_unfinished:
        run_step()
        steps += 1
        assert steps < 500, "engine failed to drain"
    assert_null_block_zero(core)
    assert core.scheduler.kv.pool.num_free_blocks == config.num_blocks - 1
    assert core.runner.null_block_writes.item() == 0
    # Every sealed block was re-verified every step (kv_checksums="full"): nothing a legitimate
    # schedule does (preemption, prefix hits, n > 1, chunks, aborts, dummies) writes a sealed
    # block or a block the step does not own.
    assert core.runner.write_guard.foreign_writes.item() == 0
    assert sum(core.integrity.checksum_mismatches.values()) == 0
