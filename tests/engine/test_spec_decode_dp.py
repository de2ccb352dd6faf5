"""Speculative decoding under DP=2 + EP (lockstep, real rank processes over gloo): while rank 0
verifies drafts (steps of 1 + k tokens per request), rank 1 has nothing and steps one dummy batch
per real step of rank 0, padded to rank 0's token count; its cache stays bitwise unchanged, the
outputs equal DP=1 without speculation, and the integrity counters stay 0 on both ranks; then
both ranks verify at once."""
from __future__ import annotations

import random

import pytest

from engine import LLM
from tests.engine.spec_helpers import quoting_prompt, write_cycling_checkpoint
from tests.engine.dp_helpers import GREEDY16, wait_stats
from tests.engine.test_dp import ENGINE_ARGS, assert_cache_clean, idle, lockstep_done, make_dp_llm, real_steps, settled

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
GREEDY = GREEDY16.__class__(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.timeout(300)
def test_dp2_dummy_rank_beside_a_verifying_rank(tmp_path):
    # DeepSeek-V3-style MoE + MLA that quotes its prompt (tests/engine/spec_helpers.py).
    path = write_cycling_checkpoint(tmp_path / "model", preset="tiny-deepseek-v3")
    rng = random.Random(0)
    prompts = [quoting_prompt(rng, quote=length) for length in (6, 11, 17, 24)]
    with LLM(path, **ENGINE_ARGS) as single:
        want = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY)]
    reports = tmp_path / "reports"
    reports.mkdir()
    llm = make_dp_llm(path, reports, speculative_config=SPEC)
    try:
        engine = llm.engine
        before, digests_before = settled(engine, reports)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, rank_of=[0] * len(prompts))]
        assert got == want
        wait_stats(engine, lockstep_done(before, busy=0, spare=1), what="one dummy per real step")
        after, digests_after = settled(engine, reports)
        assert after[1].dummy_batches > before[1].dummy_batches
        assert real_steps(after[1]) == real_steps(before[1]), "the idle rank ran a real step"
        assert after[0].spec_decode.num_accepted_tokens > 0 and after[1].spec_decode.num_drafts == 0
        assert after[0].spec_decode.num_draft_tokens > after[0].spec_decode.num_accepted_tokens  # rollbacks too
        assert digests_after[1]["digest"] == digests_before[1]["digest"], "dummy batches changed rank 1's cache"
        assert_cache_clean(after)
        for rank, s in after.items():
            assert s.integrity.foreign_writes == 0, f"rank {rank}"
            assert sum(n for _, n in s.integrity.checksum_mismatches) == 0, f"rank {rank}"
            assert s.kv_usage == 0
        for rank, report in digests_after.items():
            assert report["null_block_nonzero"] == 0, f"rank {rank}: block 0 is not bitwise zero"
        # Both ranks verifying at once, each with its own token count, padded to the larger.
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, rank_of=[0, 1, 1, 0])] == want
        wait_stats(engine, lambda st: idle(st) and st[1].spec_decode.num_drafts > 0, what="rank 1 verified drafts")
        final = dict(engine.stats)
        assert_cache_clean(final)
        assert all(s.integrity.foreign_writes == 0 and s.kv_usage == 0 for s in final.values())
    finally:
        llm.close()
