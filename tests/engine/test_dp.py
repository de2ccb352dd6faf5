"""Data parallel + expert parallel, end to end: real rank processes over gloo.

Idle ranks of a busy DP group run dummy batches; these tests check that the
dummy batches never write the KV cache (bitwise: ranks started through
dp_helpers.probed_rank report a digest of their whole cache), that outputs do not
depend on DP size or on which rank serves a request, that the old broken dummy
batch (cache_probe.LegacyDummyRunner) really does poison the next requests, that
random arrivals and aborts drain without deadlock, that an idle group does not
spin, and that a killed rank fails the client fast instead of hanging it.

One DP=2 LLM per model is shared by the module (startup costs ~10 s on 2 cores).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from engine import LLM
from engine.dp.client import EngineDeadError
from engine.sampling_params import SamplingParams
from tests.engine.dp_helpers import (GREEDY16, MIXED_LENGTHS, Collected, cache_reports, cpu_seconds, drain,
                                     free_port_block, hf_greedy, make_prompts, probed_ranks, request,
                                     wait_stats)

MODELS = ["tiny-deepseek-v3", "tiny-mixtral", "tiny-qwen3-moe"]
ENGINE_ARGS = dict(max_model_len=256, num_gpu_blocks=64, nan_sentinel="full")
SCHEDULES = {
    "default": None,
    "all-on-rank-0": [0] * len(MIXED_LENGTHS),
    "all-on-rank-1": [1] * len(MIXED_LENGTHS),
    "alternating": [0, 1] * (len(MIXED_LENGTHS) // 2),
}


def make_dp_llm(path: str, report_dir: Path | None = None, legacy_dummy: bool = False, **overrides) -> LLM:
    """A DP=2 LLM; with `report_dir` its ranks report cache digests there, with `legacy_dummy`
    they run every dummy batch the old broken way, with neither they are plain ranks."""
    probe = probed_ranks(report_dir, legacy_dummy) if report_dir or legacy_dummy else contextlib.nullcontext()
    with probe:
        return LLM(path, data_parallel_size=2, data_parallel_rpc_port=free_port_block(3),
                   **{"dtype": "float32", **{**ENGINE_ARGS, **overrides}})


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    """Where the shared groups' ranks write their cache reports."""
    return tmp_path_factory.mktemp("rank-reports")


@pytest.fixture(scope="module")
def dp_llm(checkpoint, report_dir):
    """dp_llm(model) -> a shared DP=2 LLM (created on first use, closed with the module)
    whose ranks report cache digests to `report_dir`."""
    made: dict[str, LLM] = {}

    def get(model: str) -> LLM:
        if model not in made:
            made[model] = make_dp_llm(checkpoint(model), report_dir)
        return made[model]

    yield get
    for llm in made.values():
        llm.close()


@pytest.fixture(scope="module")
def references(checkpoint):
    """references(model) -> (prompts, transformers' greedy tokens, DP=1 greedy tokens)."""
    made: dict[str, tuple] = {}

    def get(model: str):
        if model not in made:
            path = checkpoint(model)
            vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
            prompts = make_prompts(vocab, MIXED_LENGTHS, seed=1)
            hf = hf_greedy(path, prompts, GREEDY16.max_tokens)
            single = LLM(path, **{"dtype": "float32", **ENGINE_ARGS})
            dp1 = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY16)]
            made[model] = (prompts, hf, dp1)
        return made[model]

    return get


def idle(stats) -> bool:
    """Both ranks idle *and* the wave over: in lockstep the ranks end a wave with equal step
    counts, so stats that still lag behind the last steps cannot pass for a settled state."""
    return (len(stats) == 2 and all(s.num_running == 0 and s.num_waiting == 0 for s in stats.values())
            and len({s.steps for s in stats.values()}) == 1)


def settle(engine, seconds: float = 1.3) -> None:
    """Keep reading outputs for a while: ranks that are idle heartbeat fresh stats every second."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        engine.step(timeout=0.1)


def assert_cache_clean(stats) -> None:
    for rank, s in stats.items():
        assert s.integrity.null_block_writes == 0, f"rank {rank} wrote the null block"
        assert all(count == 0 for _, _, count in s.integrity.nan_values), f"rank {rank}: {s.integrity.nan_values}"
        assert s.integrity.nan_values, "nan_sentinel='full' should report per-layer values"


def settled(engine, report_dir: Path) -> tuple[dict, dict[int, dict]]:
    """Once the group is idle: (rank -> stats, rank -> cache report of those same stats)."""
    wait_stats(engine, idle, what="both ranks idle")
    reports = cache_reports(engine, report_dir)
    return dict(engine.stats), reports


# -- 2. a dummy batch leaves every byte of the idle rank's cache unchanged -------------------------

def real_steps(s) -> int:
    return s.steps - s.dummy_batches


def lockstep_done(before, busy: int, spare: int):
    """Predicate: the busy rank's stats show its real steps since `before` (ranks report on a
    timer and as the wave ends, not every step) and the spare rank's cover one dummy batch per
    real step (so they were sent after its last dummy batch of the wave)."""
    return lambda st: (real_steps(st[busy]) > real_steps(before[busy])
                       and st[spare].dummy_batches - before[spare].dummy_batches
                       == real_steps(st[busy]) - real_steps(before[busy]))


@pytest.mark.timeout(240)
def test_idle_rank_cache_bitwise_unchanged_by_dummy_batches(dp_llm, report_dir):
    """>= 100 dummy batches on rank 1 while rank 0 decodes leave every byte of rank 1's cache as
    it was (on a fresh group: all zeros, so block 0 included)."""
    from engine.worker.kv_cache import allocate_kv_cache
    from tests.engine.cache_probe import cache_digest
    llm = dp_llm("tiny-deepseek-v3")
    engine = llm.engine
    before, digests_before = settled(engine, report_dir)
    zero = cache_digest(allocate_kv_cache(llm.config.for_rank(1)))  # a freshly allocated cache
    fresh = real_steps(before[1]) == 0
    if fresh:  # the usual case: this test runs first on the module's group
        assert digests_before[1]["digest"] == zero, "a rank that never served must have an all-zero cache"

    long = SamplingParams(temperature=0.0, max_tokens=110, ignore_eos=True)
    outs = llm.generate([[5, 6, 7, 8, 9], list(range(20, 60))], long, rank_of=[0, 0])
    assert all(len(o.outputs[0].token_ids) == 110 for o in outs)
    wait_stats(engine, lockstep_done(before, busy=0, spare=1), what="one dummy per real step")
    after, digests_after = settled(engine, report_dir)
    assert after[1].dummy_batches - before[1].dummy_batches >= 100
    assert real_steps(after[1]) == real_steps(before[1])
    assert digests_after[1]["digest"] == digests_before[1]["digest"], "a dummy batch changed rank 1's cache"
    if fresh:
        assert digests_after[1]["digest"] == zero
        assert digests_after[0]["digest"] != zero  # rank 0 did write its requests' blocks (sanity)
    assert_cache_clean(after)
    for rank, report in digests_after.items():
        assert report["null_block_nonzero"] == 0, f"rank {rank}: block 0 is not bitwise zero"


# -- 1. outputs do not depend on DP size or on which rank serves a request -------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,schedule", [(m, s) for m in MODELS for s in SCHEDULES],
                         ids=[f"{m}-{s}" for m in MODELS for s in SCHEDULES])
def test_dp2_greedy_matches_transformers_and_dp1(model, schedule, dp_llm, references, report_dir):
    prompts, hf, dp1 = references(model)
    assert dp1 == hf, "DP=1 reference diverged from transformers"
    llm = dp_llm(model)
    engine = llm.engine
    before, digests_before = settled(engine, report_dir)
    outs = llm.generate(prompts, GREEDY16, rank_of=SCHEDULES[schedule])
    tokens = [o.outputs[0].token_ids for o in outs]
    for i, (got, want) in enumerate(zip(tokens, hf)):
        assert got == want, f"prompt {i} ({len(prompts[i])} tokens) diverged under {schedule}"
    assert tokens == dp1
    assert all(o.outputs[0].finish_reason == "length" for o in outs)

    spare = None
    if schedule in ("all-on-rank-0", "all-on-rank-1"):
        busy = SCHEDULES[schedule][0]
        spare = 1 - busy
        # Lockstep: the spare rank stepped exactly one dummy batch per real step of the busy one.
        wait_stats(engine, lockstep_done(before, busy, spare), what="one dummy per real step")
        after = engine.stats
        assert after[spare].dummy_batches > before[spare].dummy_batches
        assert real_steps(after[spare]) == real_steps(before[spare]), f"idle rank {spare} ran a real step"
    else:  # default routing and alternating both spread the batch over the two ranks
        wait_stats(engine, lambda st: all(real_steps(st[r]) > real_steps(before[r]) for r in (0, 1)),
                   what="both ranks served")
    final, digests_after = settled(engine, report_dir)
    if spare is not None:
        # The spare rank has served earlier requests (stale slots, live blocks): still not one byte changed.
        assert digests_after[spare]["digest"] == digests_before[spare]["digest"], \
            f"dummy batches changed rank {spare}'s cache"
    assert_cache_clean(final)
    assert all(s.kv_usage == 0 for s in final.values())


# -- 3. the old failure, reproduced; and the safe dummy batch under the same schedule --------------

LEGACY_LENGTHS = (40, 3, 21, 9)


def legacy_schedule(llm: LLM, prompts: list[list[int]]) -> Collected:
    """Rank 0 decodes a long request; rank 1 idles (dummy batches) for a few steps, then gets
    requests of mixed lengths that decode together (short rows are padded with block 0)."""
    engine = llm.engine
    collected = Collected()
    start = engine.stats[1].dummy_batches
    engine.add_request(request("bg", list(range(30, 42)),
                               SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)), rank=0)
    # bg's outputs go on being collected: on a fast core it can finish before the report shows them.
    wait_stats(engine, lambda st: st[1].dummy_batches >= start + 4, what="rank 1 dummies", sink=collected.feed)
    ids = [f"r1-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(request(rid, prompt), rank=1)
    drain(engine, collected, ids + ["bg"])
    return collected


@pytest.mark.timeout(240)
@pytest.mark.parametrize("legacy", [True, False], ids=["unsafe-legacy-dummy", "safe-dummy"])
def test_legacy_dummy_batch_poisons_idle_rank(legacy, dp_llm, checkpoint):
    path = checkpoint("tiny-deepseek-v3")
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, LEGACY_LENGTHS, seed=7)
    reference = [o.outputs[0].token_ids for o in LLM(path, **{"dtype": "float32", **ENGINE_ARGS}).generate(prompts, GREEDY16)]
    if legacy:
        llm = make_dp_llm(path, legacy_dummy=True, nan_sentinel="null-block")
    else:
        llm = dp_llm("tiny-deepseek-v3")
    try:
        engine = llm.engine
        wait_stats(engine, idle, what="both ranks idle")
        writes_before, steps_before = engine.stats[1].integrity.null_block_writes, engine.stats[1].steps
        collected = legacy_schedule(llm, prompts)
        # Ranks report as the wave ends: idle stats from after the schedule, not the ones from before.
        wait_stats(engine, lambda st: idle(st) and st[1].steps > steps_before, what="both ranks idle again")
        rank1 = engine.stats[1]
        got = [collected.tokens[f"r1-{i}"] for i in range(len(prompts))]
        logprobs = [collected.logprobs[f"r1-{i}"] for i in range(len(prompts))]
        null_nans = sum(c for _, region, c in rank1.integrity.nan_values if region == "null_block")
        if legacy:
            assert rank1.integrity.null_block_writes > writes_before, "the legacy dummy batch should write block 0"
            assert null_nans > 0, f"the sentinel should see NaN in block 0: {rank1.integrity.nan_values}"
            corrupted = [i for i in range(len(prompts))
                         if got[i] != reference[i] or any(math.isnan(v) for v in logprobs[i])]
            assert corrupted, "requests decoded over a poisoned null block should be corrupted"
            assert any(math.isnan(v) for lps in logprobs for v in lps)
            assert rank1.integrity.corrupted_requests > 0
        else:
            assert rank1.integrity.null_block_writes == writes_before == 0
            assert null_nans == 0
            assert got == reference
            assert not any(math.isnan(v) for lps in logprobs for v in lps)
            assert_cache_clean(engine.stats)
    finally:
        if legacy:
            llm.close()


# -- 4. random arrivals, aborts and long requests: no deadlock, everything drains ------------------

@pytest.mark.timeout(240)
def test_random_arrivals_and_aborts_drain(dp_llm, checkpoint):
    model = "tiny-mixtral"
    llm = dp_llm(model)
    engine = llm.engine
    vocab = llm.config.model.vocab_size
    rng = random.Random(2024)
    plan = []
    for i in range(28):
        long = i % 7 == 2  # a few long ones keep one rank busy while the other idles
        plan.append(dict(
            rid=f"rand-{i}", arrive=rng.randrange(0, 40),
            rank=rng.choice([0, 1, None]),
            prompt=[rng.randrange(3, vocab) for _ in range(rng.choice([1, 2, 7, 16, 17, 40, 90, 130]))],
            max_tokens=rng.randrange(90, 120) if long else rng.randrange(2, 24),
            abort_after=rng.choice([0, 1, 3, 6]) if rng.random() < 0.3 else None))
    plan.sort(key=lambda p: p["arrive"])
    collected = Collected()
    submitted, aborted = [], set()
    step = 0
    deadline = time.monotonic() + 180
    while len(submitted) < len(plan) or not set(submitted) <= collected.finish.keys():
        assert time.monotonic() < deadline, "random arrivals did not drain: deadlock?"
        for p in plan[len(submitted):]:
            if p["arrive"] > step:
                break
            params = SamplingParams(temperature=0.0, max_tokens=p["max_tokens"], ignore_eos=True)
            engine.add_request(request(p["rid"], p["prompt"], params), rank=p["rank"])
            submitted.append(p["rid"])
        for p in plan[:len(submitted)]:
            rid = p["rid"]
            if (p["abort_after"] is not None and rid not in aborted and rid not in collected.finish
                    and len(collected.tokens.get(rid, [])) >= p["abort_after"]):
                engine.abort([rid])
                aborted.add(rid)
        collected.feed(engine.step(timeout=0.05))
        step += 1

    assert aborted, "the plan should abort some requests"
    assert any(p["max_tokens"] >= 90 for p in plan), "the plan should include long requests"
    print(f"random arrivals: {len(plan)} requests over {step} client steps, {len(aborted)} aborted "
          f"({sum(r == 'abort' for r in collected.finish.values())} before finishing); per-rank "
          f"(steps, dummies, preemptions): {[(s.steps, s.dummy_batches, s.preemptions) for s in engine.stats.values()]}")
    finished = {}
    for p in plan:
        reason = collected.finish[p["rid"]]
        if p["rid"] in aborted:
            assert reason in ("abort", "length")
        else:
            assert reason == "length"
            assert len(collected.tokens[p["rid"]]) == p["max_tokens"]
            finished[p["rid"]] = p
    assert any(r == "abort" for r in collected.finish.values())
    wait_stats(engine, lambda st: idle(st) and all(s.kv_usage == 0 for s in st.values()), timeout=30,
               what="every rank's pool back to empty")
    assert not engine.state.tracked
    assert_cache_clean(engine.stats)
    # Completed requests are exact: the same greedy tokens as one unpadded rank.
    single = LLM(checkpoint(model), **{"dtype": "float32", **ENGINE_ARGS})
    ps = list(finished.values())
    outs = single.generate([p["prompt"] for p in ps],
                           [SamplingParams(temperature=0.0, max_tokens=p["max_tokens"], ignore_eos=True)
                            for p in ps])
    for p, out in zip(ps, outs):
        assert collected.tokens[p["rid"]] == out.outputs[0].token_ids, p["rid"]


# -- 5. an idle group blocks instead of spinning ---------------------------------------------------

@pytest.mark.timeout(120)
def test_idle_ranks_do_not_spin(dp_llm):
    llm = dp_llm("tiny-mixtral")
    engine = llm.engine
    llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), rank_of=[1])
    wait_stats(engine, idle, what="both ranks idle")
    settle(engine, 0.5)  # the wave has ended on both ranks
    pids = [p.pid for p in engine.procs]
    start = cpu_seconds(pids)
    time.sleep(5.0)
    used = cpu_seconds(pids) - start
    print(f"idle ranks: {used:.3f} s of CPU in 5 s")
    assert used < 0.2, f"idle ranks used {used:.3f} s of CPU in 5 s"
    engine.step(timeout=0.1)  # still alive and answering


# -- 6. a killed rank fails the client fast, and the survivor exits --------------------------------

class SurvivorNotStopped(AssertionError):
    """The surviving rank had to be SIGKILLed: it never got (or never honoured) Shutdown."""


class WrongRankNamed(AssertionError):
    """The error blamed a rank other than the one that was killed."""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("when,victim", [
    pytest.param("idle", 0, id="idle-kill-rank-0"),
    pytest.param("mid-wave", 1, id="mid-wave-kill-dummy-rank-1"),
    pytest.param("mid-wave", 0, id="mid-wave-kill-busy-rank-0"),
])
def test_killed_rank_raises_engine_dead(when, victim, checkpoint):
    """SIGKILL one rank: the client raises EngineDeadError naming it within seconds (also while
    the survivor is inside a wave's collectives, not hanging there), and the survivor exits."""
    llm = make_dp_llm(checkpoint("tiny-mixtral"), nan_sentinel="null-block")
    engine = llm.engine
    try:
        wait_stats(engine, idle, what="both ranks idle")
        if when == "mid-wave":  # rank 0 is busy generating; rank 1 steps dummy batches in the same wave
            engine.add_request(request("busy", [7, 8, 9],
                                       SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)), rank=0)
            wait_stats(engine, lambda st: st[1].dummy_batches >= 5 and st[0].steps >= 5, what="a wave")
        survivor = engine.procs[1 - victim]
        os.kill(engine.procs[victim].pid, signal.SIGKILL)
        start = time.monotonic()
        # The client looks again a moment later (as a busy caller would): whatever the ranks
        # reported meanwhile is read first.
        time.sleep(2.0)
        error = None
        while error is None and time.monotonic() - start < 20:
            try:
                engine.step()  # the default timeout, as LLM.generate steps
            except EngineDeadError as exc:
                error = exc
        elapsed = time.monotonic() - start
        assert error is not None, "a dead rank did not fail the client"
        survivor.join(10)
        assert survivor.exitcode is not None, "the surviving rank is still running"
        if survivor.exitcode == -signal.SIGKILL:
            raise SurvivorNotStopped(f"the surviving rank had to be killed ({elapsed:.1f} s): {error}")
        assert elapsed < 5, f"EngineDeadError took {elapsed:.1f} s: {error}"
        with pytest.raises(EngineDeadError):
            engine.add_request(request("after", [1, 2]), rank=1 - victim)
        if not re.search(f"rank {victim}\\b", str(error)):
            raise WrongRankNamed(f"rank {victim} was killed, the error says: {error}")
    finally:
        llm.close()
