"""Scheduler: chunked prefill, budgets, FCFS, preemption, aborts, n > 1 prefix sharing."""
from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from engine.config import EngineConfig
from engine.paging import NULL_BLOCK_ID
from engine.engine_core.engine_core import EngineCore
from engine.frontend.llm import LLM
from engine.messages import EngineRequest
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

BS = 4


def sched_config(**kw) -> EngineConfig:
    """A config for the scheduler alone (it never looks at the model)."""
    args = dict(model=None, block_size=BS, max_model_len=256, max_num_seqs=64,
                max_num_batched_tokens=2048, num_blocks=64, enable_prefix_caching=True)
    args.update(kw)
    return EngineConfig(**args)


_arrival = iter(range(10**9))


def req(key: str, prompt_len: int, max_tokens: int = 8, base: int = 0, **params) -> Request:
    prompt = [(base + i) % 400 + 5 for i in range(prompt_len)]
    return Request(key, 0, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                   eos_token_id=None, arrival_time=float(next(_arrival)))


def fake_update(s: Scheduler, out, token: int = 7) -> list[Request]:
    """What EngineCore._update does with a model that always samples `token`."""
    finished = []
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        s.kv.cache_computed_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            r.all_token_ids.append(token)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r, "length")
                finished.append(r)
    return finished


def run_to_end(s: Scheduler, max_steps: int = 500):
    steps = []
    while s.has_unfinished:
        out = s.schedule()
        steps.append(out)
        fake_update(s, out)
        assert len(steps) < max_steps, "scheduler made no progress"
    return steps


def assert_all_free(s: Scheduler):
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks - 1


# ------------------------------------------------------------------------------ budgets

def test_chunked_prefill_respects_token_budget():
    s = Scheduler(sched_config(max_num_batched_tokens=8))
    a, b = req("a", 20, max_tokens=3), req("b", 5, max_tokens=3, base=50)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert [(r.key, n) for r, n in first.scheduled] == [("a#0", 8)]
    fake_update(s, first)
    assert a.num_output_tokens == 0  # no token from a partial prefill
    second = s.schedule()
    assert [(r.key, n) for r, n in second.scheduled] == [("a#0", 8)]
    fake_update(s, second)
    third = s.schedule()
    # a's last 4 prompt tokens, and b's prompt is chunked into what is left.
    assert [(r.key, n) for r, n in third.scheduled] == [("a#0", 4), ("b#0", 4)]
    fake_update(s, third)
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    for out in run_to_end(s):
        assert out.num_tokens <= 8
    assert a.output_token_ids == [7, 7, 7] and b.output_token_ids == [7, 7, 7]
    assert_all_free(s)


def test_max_num_seqs_respected():
    s = Scheduler(sched_config(max_num_seqs=2))
    reqs = [req(f"r{i}", 5, max_tokens=3 + i, base=10 * i) for i in range(5)]
    for r in reqs:
        s.add(r)
    steps = run_to_end(s)
    for out in steps:
        assert out.num_reqs <= 2
    # Never more than 2 running at once, and all eventually finish.
    assert all(r.is_finished for r in reqs)
    assert_all_free(s)


def test_running_never_exceeds_max_num_seqs():
    s = Scheduler(sched_config(max_num_seqs=3))
    for i in range(7):
        s.add(req(f"r{i}", 3, max_tokens=4, base=i))
    while s.has_unfinished:
        out = s.schedule()
        assert len(s.running) <= 3
        fake_update(s, out)


def test_fcfs_admission_order():
    s = Scheduler(sched_config(max_num_batched_tokens=10))
    reqs = [req(f"r{i}", 6, max_tokens=2, base=20 * i) for i in range(4)]
    for r in reqs:
        s.add(r)
    admitted = []  # the order requests join the running batch (the step's list puts decodes first)
    while s.has_unfinished:
        out = s.schedule()
        for r in s.running:
            if r.key not in admitted:
                admitted.append(r.key)
        fake_update(s, out)
    assert admitted == [r.key for r in reqs]


def test_fcfs_big_head_blocks_small_followers():
    """A waiting request that does not fit is not overtaken by a later, smaller one."""
    s = Scheduler(sched_config(num_blocks=6))  # 5 usable blocks
    holder = req("holder", 12, max_tokens=2)    # 3 blocks (+1 when it decodes)
    s.add(holder)
    fake_update(s, s.schedule())
    big, small = req("big", 12, base=100), req("small", 2, base=200)
    s.add(big)
    s.add(small)
    out = s.schedule()
    assert [r.key for r, _ in out.scheduled] == ["holder#0"]
    assert list(s.waiting) == [big, small]


def test_prefix_stats_count_a_blocked_request_once():
    s = Scheduler(sched_config(num_blocks=6))  # 5 usable
    prefix = list(range(100, 108))
    a = Request("a", 0, prefix + [1], SamplingParams(max_tokens=1, temperature=0.0), None, 0.0)
    s.add(a)
    fake_update(s, s.schedule())  # a computes 3 blocks, caches 2, finishes
    assert a.is_finished and len(s.kv.pool.cached) == 2
    holder = req("holder", 12, max_tokens=50, base=300)
    s.add(holder)
    fake_update(s, s.schedule())  # 3 blocks; only a's 2 cached blocks are left free
    blocked = Request("w", 0, prefix + list(range(200, 209)), SamplingParams(max_tokens=2), None, 0.0)
    s.add(blocked)
    for _ in range(3):
        out = s.schedule()
        assert blocked not in [r for r, _ in out.scheduled]
        fake_update(s, out)
    # Only admitted requests were looked up: a (9 tokens, no hit) and holder (12 tokens, no hit).
    assert s.kv.prefix_queries == 9 + 12
    assert s.kv.prefix_hits == 0


# ------------------------------------------------------------------------------ preemption

def test_preemption_newest_running_goes_to_front_of_queue():
    s = Scheduler(sched_config(num_blocks=7))  # 6 usable
    old, mid = req("old", 7, max_tokens=8), req("mid", 7, max_tokens=8, base=100)
    s.add(old)
    s.add(mid)
    fake_update(s, s.schedule())                 # both prefilled: 2 blocks each (room for 1 more token), 2 free
    late = req("late", 3, max_tokens=8, base=300)
    other = req("other", 3, max_tokens=2, base=350)
    s.add(late)
    s.add(other)
    fake_update(s, s.schedule())                 # both admitted: 1 block each, 0 free
    assert [r.key for r in s.running] == ["old#0", "mid#0", "late#0", "other#0"]
    assert s.kv.pool.num_free_blocks == 0
    out = s.schedule()      # old and mid each need a 3rd block: the two newest go, newest first
    assert out.preempted == [other, late]
    for r in (other, late):
        assert r.status is RequestStatus.PREEMPTED
        assert r.num_computed_tokens == 0 and r.block_ids == []
    assert list(s.waiting) == [late, other]  # back at the front, still in arrival order
    assert [r.key for r, _ in out.scheduled] == ["old#0", "mid#0"]
    assert old.status is RequestStatus.RUNNING and mid.status is RequestStatus.RUNNING
    assert s.num_preemptions >= 1
    fake_update(s, out)
    run_to_end(s)
    assert all(r.is_finished for r in (old, mid, late, other))
    assert old.output_token_ids == [7] * 8 and other.output_token_ids == [7] * 2
    assert_all_free(s)


def test_preempted_request_requeued_ahead_of_older_waiting():
    s = Scheduler(sched_config(num_blocks=5, max_num_seqs=2))  # 4 usable
    a, b = req("a", 4, max_tokens=6), req("b", 4, max_tokens=6, base=100)
    c = req("c", 2, max_tokens=2, base=200)
    for r in (a, b, c):
        s.add(r)
    fake_update(s, s.schedule())  # a, b admitted (1 block each); c waits (max_num_seqs)
    while True:
        out = s.schedule()
        if out.preempted:
            break
        fake_update(s, out)
    assert out.preempted == [b]
    assert list(s.waiting) == [b, c]  # preempted b goes to the FRONT, before c


def test_preemption_picks_the_newest():
    s = Scheduler(sched_config(num_blocks=9))  # 8 usable
    reqs = [req(f"r{i}", 7, max_tokens=20, base=50 * i) for i in range(3)]
    for r in reqs:
        s.add(r)
    fake_update(s, s.schedule())  # 2 blocks each: 6 used
    while True:
        out = s.schedule()
        if out.preempted:
            break
        fake_update(s, out)
    assert out.preempted[0] is reqs[2]
    assert reqs[2] not in s.running and s.waiting[0] is reqs[2]
    assert {r.key for r, _ in out.scheduled} <= {"r0#0", "r1#0"}
    # No admission from the waiting queue in a step that preempted.
    assert reqs[2] not in [r for r, _ in out.scheduled]


# ------------------------------------------------------------------------------ aborts

def test_abort_running_frees_blocks_at_once():
    s = Scheduler(sched_config(num_blocks=16))
    a, b = req("a", 9, max_tokens=5), req("b", 9, max_tokens=5, base=100)
    s.add(a)
    s.add(b)
    fake_update(s, s.schedule())
    free_before = s.kv.pool.num_free_blocks
    a_blocks = list(a.block_ids)
    aborted = s.abort("a")
    assert aborted == [a]
    assert a.finish_reason == "abort" and a.is_finished
    assert a.block_ids == [] and a not in s.running
    assert s.kv.pool.num_free_blocks == free_before + len(a_blocks)
    assert all(s.kv.pool.ref_counts[x] == 0 for x in a_blocks)
    out = s.schedule()
    assert [r.key for r, _ in out.scheduled] == ["b#0"]
    assert s.abort("a") == []  # unknown / already finished: nothing


def test_abort_waiting_and_preempted():
    s = Scheduler(sched_config(num_blocks=16, max_num_seqs=1))
    a, b = req("a", 5), req("b", 5, base=100)
    s.add(a)
    s.add(b)
    fake_update(s, s.schedule())
    assert b in s.waiting
    s.abort("b")
    assert b not in s.waiting and b.finish_reason == "abort"
    run_to_end(s)
    assert a.finish_reason == "length" and b.num_output_tokens == 0
    assert_all_free(s)


def test_abort_all_samples_of_a_request():
    s = Scheduler(sched_config())
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = None
    samples = []
    for i in range(3):
        r = Request("x", i, list(range(5, 15)), params, None, 0.0, wait_for=first)
        first = first or r
        samples.append(r)
        s.add(r)
    fake_update(s, s.schedule())
    assert s.kv.pool.num_free_blocks < s.kv.pool.num_blocks - 1
    assert sorted(r.index for r in s.abort("x")) == [0, 1, 2]
    assert not s.has_unfinished
    assert_all_free(s)


# ------------------------------------------------------------------------------ with the model

@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("tiny-llama")


def core(ckpt, **kw) -> EngineCore:
    args = dict(num_gpu_blocks=128, block_size=BS, max_model_len=128)
    args.update(kw)
    return EngineCore(EngineConfig.create(ckpt, **{"dtype": "float32", **args}))


PROMPTS = [[0] + [(7 * i + 13 * j) % 500 + 5 for j in range(9 + 2 * i)] for i in range(4)]


def run_core(engine: EngineCore, prompts, params: SamplingParams, max_steps: int = 2000):
    tokens = {str(i): [] for i in range(len(prompts))}
    reasons = {}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, params, eos_token_id=None))
    steps = 0
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        assert steps < max_steps
    return [tokens[str(i)] for i in range(len(prompts))], reasons


def test_preemption_resumes_with_same_greedy_tokens(ckpt):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    ref, _ = run_core(core(ckpt), PROMPTS, params)
    small = core(ckpt, num_gpu_blocks=13)  # 12 usable blocks for ~4 x 6 needed
    out, reasons = run_core(small, PROMPTS, params)
    assert small.scheduler.num_preemptions > 0
    assert out == ref
    assert all(len(t) == 12 for t in out) and set(reasons.values()) == {"length"}
    assert small.scheduler.kv.pool.num_free_blocks == 12


def test_preemption_without_prefix_cache_same_tokens(ckpt):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    ref, _ = run_core(core(ckpt, enable_prefix_caching=False), PROMPTS, params)
    small = core(ckpt, num_gpu_blocks=13, enable_prefix_caching=False, max_num_batched_tokens=8)
    out, _ = run_core(small, PROMPTS, params)
    assert small.scheduler.num_preemptions > 0
    assert out == ref


def test_preempted_seeded_sampling_same_tokens(ckpt):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12)
    ref, _ = run_core(core(ckpt), PROMPTS, params)
    small = core(ckpt, num_gpu_blocks=13)
    out, _ = run_core(small, PROMPTS, params)
    assert small.scheduler.num_preemptions > 0
    assert out == ref


def test_prompt_logprobs_not_duplicated_by_preemption(ckpt):
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=1)
    with LLM(ckpt, num_gpu_blocks=13, block_size=BS, max_model_len=128, dtype="float32") as llm:
        outs = llm.generate(PROMPTS, params)
        assert llm.engine.scheduler.num_preemptions > 0
    for prompt, o in zip(PROMPTS, outs):
        assert len(o.prompt_logprobs) == len(prompt)
        assert o.prompt_logprobs[0] is None and all(x is not None for x in o.prompt_logprobs[1:])


def test_engine_abort_frees_blocks_and_reports(ckpt):
    engine = core(ckpt)
    params = SamplingParams(temperature=0.0, max_tokens=50)
    engine.add_request(EngineRequest("a", PROMPTS[3], params))
    engine.add_request(EngineRequest("b", PROMPTS[2], params))
    engine.step()
    engine.step()
    used = engine.scheduler.kv.pool.num_blocks - 1 - engine.scheduler.kv.pool.num_free_blocks
    assert used > 0
    engine.abort(["a", "b"])
    assert not engine.has_unfinished
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks - 1
    outs = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "abort"), ("b", "abort")]


def test_n_siblings_wait_then_hit_prefix_cache(ckpt):
    engine = core(ckpt)
    prompt = [0] + list(range(20, 39))  # 20 tokens = 5 full blocks
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4)
    engine.add_request(EngineRequest("n3", prompt, params))
    first = engine.schedule()
    assert [(r.index, n) for r, n in first.scheduled] == [(0, 20)]
    outs = engine.step(first)
    assert [o.index for o in outs] == [0]
    second = engine.schedule()
    siblings = {r.index: (r, n) for r, n in second.scheduled}
    assert set(siblings) == {0, 1, 2}
    for i in (1, 2):
        r, n = siblings[i]
        assert r.num_cached_tokens == 16 and n == 4  # 4 of 5 blocks hit; >= 1 token computed
        assert r.block_ids[:4] == siblings[0][0].block_ids[:4]
    engine.step(second)
    stats = engine.stats()
    assert stats.prefix_hits == 32
    samples = {}
    while engine.has_unfinished:
        for o in engine.step():
            samples.setdefault(o.index, []).extend(o.new_token_ids)
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks - 1
    assert NULL_BLOCK_ID not in engine.scheduler.kv.pool.free_queue


def test_n_siblings_through_llm_share_prefix(ckpt):
    with LLM(ckpt, num_gpu_blocks=128, block_size=BS, max_model_len=128, dtype="float32") as llm:
        prompt = [0] + list(range(40, 59))
        [out] = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6))
        assert len(out.outputs) == 4 and [o.index for o in out.outputs] == [0, 1, 2, 3]
        assert all(len(o.token_ids) == 6 for o in out.outputs)
        assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # seed + index differ per sample
        stats = llm.engine.stats()
        assert stats.prefix_hits >= 3 * 16
        assert out.num_cached_tokens == 16
