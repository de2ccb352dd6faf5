"""Speculative decoding end to end on a tiny model that quotes its prompt
(tests/engine/spec_helpers.py): greedy output token-identical with and without it, stops inside
an accepted run honoured, sampled output following the same distribution (chi-square), and the
cache invariants of tests/engine/test_invariants.py -- with drafts rolled back -- holding step
by step with every integrity counter at 0."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.block_pool import hash_block
from engine.engine_core.engine_core import EngineCore
from engine.messages import EngineRequest
from engine.paging import PAD_SLOT_ID
from tests.engine.spec_helpers import NEXT, SPEC, quoting_prompt, walk, write_cycling_checkpoint
from tests.engine.test_invariants import assert_null_block_zero, cache_bits, changed_slots, record_kv_writes, scheduled_slots
from tests.engine.test_spec_decode import MIN_P_VALUE

BLOCK = 4
# A few requests a step: a full batch of 64 would (rightly, by gate.py) verify only near-certain drafts.
ARGS = dict(max_model_len=256, block_size=BLOCK, num_gpu_blocks=300, kv_checksums="full", max_num_seqs=4)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_cycling_checkpoint(tmp_path_factory.mktemp("cycling"))


@pytest.fixture(scope="module")
def plain(path):
    with LLM(path, **ARGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec(path):
    with LLM(path, speculative_config=SPEC, **ARGS) as llm:
        yield llm


def _integrity_clean(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.integrity.foreign_writes == 0
    assert stats.integrity.null_block_writes == 0
    assert sum(n for _, n in stats.integrity.checksum_mismatches) == 0
    assert sum(n for _, n in stats.integrity.nan_detections) == 0
    assert llm.engine.scheduler.kv.pool.num_free_blocks == llm.config.num_blocks - 1


def test_greedy_identical_with_and_without_speculation(plain, spec):
    rng = random.Random(1)
    prompts = [quoting_prompt(rng, quote=rng.randrange(6, 20)) for _ in range(10)]
    prompts += [[rng.randrange(5, 512) for _ in range(rng.randrange(3, 30))] for _ in range(4)]  # free text
    start = torch.randint(5, 512, (1,), generator=torch.Generator().manual_seed(3)).item()
    stop_token = walk(start, 9)[8]
    params = ([SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 7, 24, 40)]
              + [SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
                 SamplingParams(temperature=0.0, max_tokens=30, min_tokens=10, stop_token_ids=[prompts[7][-1]]),
                 SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, ignore_eos=True),  # no speculation
                 SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2)])
    params += [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)] * (len(prompts) - len(params))
    # A stop token the quote reaches inside an accepted run.
    prompts.append([9, 10, 11] + walk(start, 12) + [40, 41, start])
    params.append(SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_token]))
    before = spec.engine.stats().spec_decode.copy()
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    for w, g in zip(want, got):
        for a, b in zip(w.outputs, g.outputs):
            assert b.token_ids == a.token_ids and (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason)
    assert got[-1].outputs[0].finish_reason == "stop" and got[-1].outputs[0].token_ids[-1] == stop_token
    assert len(got[-1].outputs[0].token_ids) == 8
    after = spec.engine.stats().spec_decode
    assert after.num_accepted_tokens - before.num_accepted_tokens > 20
    assert after.num_draft_tokens > after.num_accepted_tokens  # free text and quote ends were rejected
    _integrity_clean(spec)


def test_sampled_output_follows_the_same_distribution(plain, spec):
    """600 seeded samples of 4 tokens each, with and without speculation: the joint of
    "token i + 1 continues the cycle from token i" (i = 0, 1, 2: positions verified as drafts
    and bonus tokens) has the same distribution (chi-square on the 2 x 8 table)."""
    prompt = [17, 33] + walk(100, 10) + [200, 300, 100]
    samples = 600

    def pattern_counts(llm: LLM, seed0: int) -> list[int]:
        params = [SamplingParams(temperature=1.0, top_k=50, max_tokens=4, ignore_eos=True, seed=seed0 + i)
                  for i in range(samples)]
        counts = [0] * 8
        for out in llm.generate([prompt] * samples, params):
            tokens = out.outputs[0].token_ids
            counts[sum((NEXT[tokens[i]] == tokens[i + 1]) << i for i in range(3))] += 1
        return counts

    before = spec.engine.stats().spec_decode.copy()
    a, b = pattern_counts(plain, 0), pattern_counts(spec, 10_000)
    accepted = spec.engine.stats().spec_decode.num_accepted_tokens - before.num_accepted_tokens
    assert accepted > samples  # most verify steps accept
    # Two-sample chi-square: expected counts from the pooled table.
    stat, dof = 0.0, -1
    for x, y in zip(a, b):
        if x + y == 0:
            continue
        dof += 1
        for observed in (x, y):
            expected = (x + y) / 2
            stat += (observed - expected) ** 2 / expected
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    assert p > MIN_P_VALUE, (a, b, p)
    # Not vacuous: the continuation is likely, not certain, at every position.
    assert 0.3 * samples < a[7] < 0.9 * samples


def test_rollback_keeps_the_cache_invariants(path, monkeypatch):
    """Step by step, with prefix caching and preemptions (a small pool): the slots written are
    exactly the scheduled tokens' (drafts included); a block is sealed and registered in the
    prefix cache only over accepted tokens; lookahead blocks go back after each step; and the
    checksums (verified every step), the foreign-write guard and the null block stay clean."""
    config = EngineConfig.create(path, max_model_len=128, block_size=BLOCK, num_gpu_blocks=40,
                                 max_num_batched_tokens=32, max_num_seqs=6, enable_prefix_caching=True,
                                 kv_checksums="full", speculative_config=SPEC)
    core = EngineCore(config)
    written = record_kv_writes(monkeypatch)
    rng = random.Random(5)
    stems = [quoting_prompt(rng, quote=16) for _ in range(3)]
    for i in range(12):
        prompt = stems[i % 3] if i % 2 else quoting_prompt(rng, quote=rng.randrange(4, 20))
        core.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i,
                                                                       max_tokens=rng.randrange(5, 40), ignore_eos=True)))
    verify_steps = steps = 0
    while core.has_unfinished:
        sched = core.schedule()
        verify_steps += bool(sched.spec_token_ids)
        expected = scheduled_slots(sched, BLOCK)
        before = cache_bits(core)
        written.clear()
        core.step(sched)
        got = torch.cat(written).tolist() if written else []
        assert sorted(got) == sorted(list(expected) * config.model.num_layers)
        assert changed_slots(before, cache_bits(core)) <= expected
        assert bool((core.runner.builder.slot_mapping[sched.num_tokens:] == PAD_SLOT_ID).all())
        for request in core.scheduler.requests.values():
            computed = request.num_computed_tokens
            assert computed < request.num_tokens or not request.block_ids  # the rollback: never past the tokens
            assert len(request.block_ids) <= -(-request.num_tokens // BLOCK), "a lookahead block kept"
            full = request.block_ids[:computed // BLOCK]
            assert all(core.integrity.checksums.sealed[b] for b in full), "a full block was not sealed"
            assert not any(core.integrity.checksums.sealed[b] for b in request.block_ids[computed // BLOCK:]), \
                "a block sealed over uncomputed slots"
            assert request.num_hashed_blocks * BLOCK <= computed
            parent = None
            for i, block in enumerate(request.block_ids[:request.num_hashed_blocks]):
                parent = hash_block(parent, request.all_token_ids[i * BLOCK:(i + 1) * BLOCK])
                assert core.scheduler.kv.pool.block_hash[block] in (None, parent)
        assert_null_block_zero(core)
        steps += 1
        assert steps < 2000
    assert verify_steps > 5 and core.speculator.stats.num_accepted_tokens > 0
    assert core.scheduler.kv.pool.num_free_blocks == config.num_blocks - 1
    assert core.runner.null_block_writes.item() == 0
    assert core.runner.write_guard.foreign_writes.item() == 0
    assert sum(core.integrity.checksum_mismatches.values()) == 0
