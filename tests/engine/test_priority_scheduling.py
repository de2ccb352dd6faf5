"""--scheduling-policy priority (engine/core/request_queue.py): admission by (aged priority,
arrival), preemption of the lowest-ranked running request, FCFS among equals, starvation
bounded by --priority-aging-steps; fcfs unchanged and refusing priorities; DP routing and the
ranks' waiting counts untouched by priorities."""
from __future__ import annotations

import time

import msgspec
import pytest

from engine import LLM
from engine.config import EngineConfig
from engine.core.request_queue import PriorityRequestQueue, RequestQueue
from engine.core.scheduler import Scheduler
from engine.core.validation import InvalidRequest, validate_priority
from engine.dp.client import ClientState
from engine.engine_core.engine_core import EngineCore
from engine.messages import EngineInput, EngineRequest
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from tests.engine.dp_helpers import Collected, free_port_block, make_prompts, request, wait_stats
from tests.engine.test_scheduler import BS, PROMPTS, assert_all_free, fake_update, sched_config


def preq(key: str, priority: int, prompt_len: int = 7, max_tokens: int = 8, base: int = 0) -> Request:
    prompt = [(base + i) % 400 + 5 for i in range(prompt_len)]
    return Request(key, 0, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   eos_token_id=None, arrival_time=0.0, priority=priority)


def first_token_order(s: Scheduler, on_step=None, max_steps: int = 2000) -> list[Request]:
    """Run to the end with a model that always samples 7; the requests in the order they got
    their first token (within a step, in the order the step scheduled them)."""
    order: list[Request] = []
    steps = 0
    while s.has_unfinished:
        if on_step is not None:
            on_step(steps)
        out = s.schedule()
        before = {r: r.num_output_tokens for r, _ in out.scheduled}
        fake_update(s, out)
        order += [r for r, _ in out.scheduled if before[r] == 0 and r.num_output_tokens == 1]
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return order


# ------------------------------------------------------------------------------ admission

@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_zero_overtakes_32_earlier_priority_ten(policy):
    # 16 usable blocks; each request needs 4 (7 prompt + 8 output tokens): about 4 run at once.
    s = Scheduler(sched_config(num_blocks=17, scheduling_policy=policy))
    batch = [preq(f"batch{i}", 10, base=37 * i) for i in range(32)]
    for r in batch:
        s.add(r)
    interactive = preq("interactive", 0, base=999)

    def arrive(step: int) -> None:
        if step == 1:  # after one step: the cache is full, 24 of the 32 wait
            assert s.kv.pool.num_free_blocks == 0 and len(s.running) == 8 and len(s.waiting) == 24
            s.add(interactive)

    order = first_token_order(s, on_step=arrive)
    assert len(order) == 33
    ahead = order.index(interactive)
    if policy == "priority":
        # Only the 8 running when it arrived go first: it is next as soon as blocks free up.
        assert ahead == 8, [r.key for r in order]
    else:  # the fcfs control: the same requests, priorities ignored, arrival order
        assert ahead == 32
    assert_all_free(s)


def test_equal_priority_is_fcfs():
    s = Scheduler(sched_config(num_blocks=9, scheduling_policy="priority"))  # 8 usable: 2 at a time
    priorities = [5, 0, 5, 3, 0, 5, 3, 0, 5, 0]
    reqs = [preq(f"r{i}", p, base=41 * i) for i, p in enumerate(priorities)]
    for r in reqs:
        s.add(r)
    assert [r.key for r in s.waiting] == [r.key for r in sorted(reqs, key=lambda r: r.priority)]  # stable: FCFS
    order = first_token_order(s)
    assert [r.priority for r in order] == sorted(priorities)
    for level in set(priorities):
        same = [r for r in order if r.priority == level]
        assert same == [r for r in reqs if r.priority == level]  # arrival order within a level
    assert_all_free(s)


# ------------------------------------------------------------------------------ preemption

def test_lowest_priority_running_request_is_preempted():
    s = Scheduler(sched_config(num_blocks=9, scheduling_policy="priority"))  # 8 usable
    a, b, c, d = preq("a", 3), preq("b", 7, base=100), preq("c", 1, base=200), preq("d", 7, base=300)
    for r in (a, b, c, d):  # arrival order a, b, c, d
        s.add(r)
    out = s.schedule()  # all four prefilled: 2 blocks each (7 tokens, room for 1 more), 0 free
    assert {r.key for r, _ in out.scheduled} == {"a#0", "b#0", "c#0", "d#0"}
    assert s.running == [c, a, b, d]  # by priority, then arrival
    fake_update(s, out)
    fake_update(s, s.schedule())  # position 7: the last free slot of each second block
    out = s.schedule()  # position 8 needs a third block each: the lowest go, the latest p7 first
    assert out.preempted == [d, b]
    assert [r.key for r, _ in out.scheduled] == ["c#0", "a#0"]
    for r in (b, d):
        assert r.status is RequestStatus.PREEMPTED and r.block_ids == [] and r.num_computed_tokens == 0
    assert list(s.waiting) == [b, d]  # back in the queue in their own order
    fake_update(s, out)
    first_token_order(s)
    assert all(r.is_finished and r.output_token_ids == [7] * 8 for r in (a, b, c, d))
    assert_all_free(s)


def test_fcfs_preempts_the_newest_whatever_the_priority():
    s = Scheduler(sched_config(num_blocks=9))  # fcfs: exactly as without priorities
    a, b, c, d = preq("a", 3), preq("b", 7, base=100), preq("c", 1, base=200), preq("d", 7, base=300)
    for r in (a, b, c, d):
        s.add(r)
    fake_update(s, s.schedule())
    assert s.running == [a, b, c, d]
    fake_update(s, s.schedule())
    assert s.schedule().preempted == [d, c]


def test_preempted_request_keeps_its_arrival_among_equals():
    s = Scheduler(sched_config(num_blocks=7, scheduling_policy="priority", max_num_seqs=2))  # 6 usable
    old, new = preq("old", 4), preq("new", 4, base=100)
    late = preq("late", 4, prompt_len=3, base=200)
    for r in (old, new):
        s.add(r)
    fake_update(s, s.schedule())
    s.add(late)  # same priority, arrives after `new`
    while True:
        out = s.schedule()
        if out.preempted:
            break
        fake_update(s, out)
    assert out.preempted == [new]
    assert list(s.waiting) == [new, late]  # `new` arrived before `late`: it goes back ahead of it


# ------------------------------------------------------------------------------ aging

def stream_against_one_low(aging_steps: int, steps: int) -> tuple[Request, dict[Request, int], list[Request]]:
    """One priority-10 request, then a priority-0 request arriving every step for `steps` steps,
    one running at a time (each takes 2 steps). Returns the low request, each request's arrival
    step and the order of first tokens."""
    s = Scheduler(sched_config(num_blocks=64, max_num_seqs=1, scheduling_policy="priority",
                               priority_aging_steps=aging_steps))
    low = preq("low", 10, max_tokens=2)
    s.add(low)
    arrived = {low: 0}

    def arrive(step: int) -> None:
        if step < steps:
            r = preq(f"p0-{step}", 0, max_tokens=2, base=3 * step)
            arrived[r] = step
            s.add(r)

    return low, arrived, first_token_order(s, on_step=arrive, max_steps=10 * steps)


def test_aging_lets_a_low_priority_request_through_within_the_bound():
    aging = 4
    low, arrived, order = stream_against_one_low(aging, steps=150)
    bound = (10 - 0) * aging  # never overtaken by a request arriving more than this many steps after it
    overtakers = order[:order.index(low)]
    assert overtakers, "the stream of priority-0 requests should go first for a while"
    assert max(arrived[r] for r in overtakers) <= arrived[low] + bound
    # Every priority-0 request that arrived less than the bound after it went first (one arriving
    # exactly at the bound ties, and loses on arrival): the bound is reached, not undercut.
    assert len(overtakers) == bound


def test_without_aging_the_stream_starves_the_low_priority_request():
    low, arrived, order = stream_against_one_low(0, steps=150)
    assert order[-1] is low  # it runs only once the stream stops


def test_aging_steps_orders_by_rank_then_arrival():
    queue = PriorityRequestQueue(aging_steps=4)
    early_low = preq("early", 2)
    queue.add(early_low)  # rank 2*4 + 0 = 8
    for _ in range(8):
        queue.step()
    tie = preq("tie", 0)
    queue.add(tie)  # rank 0*4 + 8 = 8: the earlier arrival goes first
    queue.step()
    late = preq("late", 0)
    queue.add(late)  # rank 9
    assert list(queue) == [early_low, tie, late]
    assert queue.pop() is early_low and queue.peek() is tie


def test_an_aged_request_is_not_the_next_victim():
    # A request the queue let through because it aged must not be preempted for its plain
    # priority, or a stream of better requests would starve it again.
    s = Scheduler(sched_config(num_blocks=9, scheduling_policy="priority", priority_aging_steps=2))
    old = preq("old", 1, max_tokens=12)  # rank 1*2 + 0 = 2; 5 blocks in the end
    s.add(old)
    for _ in range(3):
        fake_update(s, s.schedule())
    new = preq("new", 0, max_tokens=12, base=100)  # rank 0*2 + 3 = 3: it came after old caught up
    s.add(new)
    fake_update(s, s.schedule())
    assert s.running == [old, new]
    for _ in range(20):  # 8 usable blocks, 10 wanted: one of them goes
        out = s.schedule()
        if out.preempted:
            break
        fake_update(s, out)
    assert out.preempted == [new]


# ------------------------------------------------------------------------------ the engine

@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("tiny-llama")


def run_engine(engine: EngineCore, priorities: list[int]) -> list[list[int]]:
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for i, (prompt, priority) in enumerate(zip(PROMPTS, priorities)):
        engine.add_request(EngineRequest(str(i), prompt, params, priority=priority))
    steps = 0
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        assert steps < 2000
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def test_greedy_outputs_unchanged_by_priority_preemption(ckpt):
    reference = run_engine(EngineCore(EngineConfig.create(ckpt, num_gpu_blocks=128, block_size=BS,
                                                          max_model_len=128)), [0] * len(PROMPTS))
    small = EngineCore(EngineConfig.create(ckpt, num_gpu_blocks=13, block_size=BS, max_model_len=128,
                                           scheduling_policy="priority", kv_checksums="full"))
    out = run_engine(small, [5, 0, 9, 2])
    assert small.scheduler.num_preemptions > 0
    assert out == reference
    stats = small.integrity.stats()
    assert stats.foreign_writes == 0 and sum(total for _, total in stats.checksum_mismatches) == 0
    assert stats.sealed_blocks > 0  # the checksums did watch the blocks preemption freed and refilled
    assert small.scheduler.kv.pool.num_free_blocks == 12


def test_a_rank_reports_its_waiting_requests_under_priority(ckpt):
    engine = EngineCore(EngineConfig.create(ckpt, num_gpu_blocks=128, block_size=BS, max_model_len=128,
                                            scheduling_policy="priority", max_num_seqs=1))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for i, priority in enumerate([3, 1, 2]):
        engine.add_request(EngineRequest(f"r{i}", PROMPTS[i], params, priority=priority))
    assert engine.stats().num_waiting == 3
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 2)
    assert engine.scheduler.running[0].request_id == "r1"


# ------------------------------------------------------------------------------ refusals, DP

def test_fcfs_refuses_a_priority_other_than_zero(ckpt):
    fcfs = EngineConfig.create(ckpt, num_gpu_blocks=16, block_size=BS, max_model_len=128)
    validate_priority(fcfs, 0)
    with pytest.raises(InvalidRequest, match="fcfs scheduling policy") as info:
        validate_priority(fcfs, 3)
    assert info.value.field == "priority"
    with pytest.raises(InvalidRequest, match="priority"):
        EngineCore(fcfs).add_request(EngineRequest("x", PROMPTS[0], SamplingParams(), priority=-1))
    priority = EngineConfig.create(ckpt, num_gpu_blocks=16, block_size=BS, max_model_len=128,
                                   scheduling_policy="priority")
    validate_priority(priority, -5)
    with pytest.raises(InvalidRequest, match="must be in"):
        validate_priority(priority, 2**40)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig.create(ckpt, num_gpu_blocks=16, scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority_aging_steps"):
        EngineConfig.create(ckpt, num_gpu_blocks=16, priority_aging_steps=-1)


def test_offline_llm_takes_priorities(ckpt):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    with LLM(ckpt, num_gpu_blocks=16, block_size=BS, max_model_len=128) as fcfs:
        reference = [o.outputs[0].token_ids for o in fcfs.generate(PROMPTS[:2], params)]
        with pytest.raises(InvalidRequest, match="fcfs"):
            fcfs.generate(PROMPTS[:2], params, priority=[0, 1])
    with LLM(ckpt, num_gpu_blocks=16, block_size=BS, max_model_len=128, scheduling_policy="priority") as llm:
        outs = llm.generate(PROMPTS[:2], params, priority=[4, -4])
        assert [o.outputs[0].token_ids for o in outs] == reference  # returned in prompt order
        with pytest.raises(ValueError, match="one priority per prompt"):
            llm.generate(PROMPTS[:2], params, priority=[1])


def test_fcfs_queue_is_the_old_deque_order():
    queue = RequestQueue()
    a, b, c = preq("a", 9), preq("b", 0), preq("c", 5)
    for r in (a, b, c):
        queue.add(r)
    queue.requeue(queue.pop())
    assert list(queue) == [a, b, c] and queue[0] is a


def test_dp_routing_ignores_priority_and_the_rank_gets_it(ckpt):
    config = EngineConfig.create(ckpt, num_gpu_blocks=16, block_size=BS, max_model_len=128,
                                 data_parallel_size=2, scheduling_policy="priority")
    plain, prioritised = ClientState(config), ClientState(config)
    decoder = msgspec.msgpack.Decoder(EngineInput)
    for i in range(6):
        [(rank_a, _)] = plain.route(EngineRequest(f"r{i}", [5, 6], SamplingParams()))
        [(rank_b, payload)] = prioritised.route(EngineRequest(f"r{i}", [5, 6], SamplingParams(), priority=i % 3 - 1))
        assert rank_a == rank_b  # least-loaded routing, as without priorities
        assert decoder.decode(payload).priority == i % 3 - 1
    assert plain.waiting == prioritised.waiting == [3, 3]


def test_dp_ranks_each_order_their_own_queue(checkpoint):
    # MoE at DP = 2: the ranks step in lockstep, the idle one on dummy batches.
    llm = LLM(checkpoint("tiny-mixtral"), data_parallel_size=2, data_parallel_rpc_port=free_port_block(3),
              max_model_len=1024, num_gpu_blocks=96, max_num_seqs=1, scheduling_policy="priority")
    try:
        engine = llm.engine
        prompts = make_prompts(llm.config.model.vocab_size, lengths=(5, 6, 7, 8, 9), seed=3)
        short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        # The blocker holds rank 0's one sequence slot while the rest queue behind it.
        engine.add_request(request("blocker", prompts[0], SamplingParams(temperature=0.0, max_tokens=1000,
                                                                         ignore_eos=True)), rank=0)
        for i, (rid, priority) in enumerate([("batch0", 10), ("batch1", 10), ("interactive", 0)], start=1):
            engine.add_request(EngineRequest(rid, prompts[i], short, priority=priority), rank=0)
        engine.add_request(EngineRequest("other", prompts[4], short, priority=7), rank=1)
        collected, first_token = Collected(), []

        def collect(outputs) -> None:
            # One call may carry several steps' outputs of a request (the ranks ran ahead of the
            # reader), so only the first with tokens counts.
            for out in outputs:
                if out.new_token_ids and out.request_id not in first_token:
                    first_token.append(out.request_id)
            collected.feed(outputs)

        # Rank 0 reports its waiting work as it is, priorities or not. (Rank 1's "other" may end
        # meanwhile: its outputs are kept.)
        wait_stats(engine, lambda st: 0 in st and (st[0].num_running, st[0].num_waiting) == (1, 3),
                   what="rank 0 running 1 and waiting 3", sink=collect)
        assert engine.state.waiting[0] == 3  # the front end's count: priorities do not change routing
        engine.abort(["blocker"])  # the slot frees: rank 0 admits from its queue, best first
        deadline = time.monotonic() + 120
        while len(collected.finish) < 5:
            assert time.monotonic() < deadline, f"not drained: {collected.finish}"
            collect(engine.step(timeout=0.5))
        assert collected.finish.pop("blocker") == "abort"
        assert set(collected.finish.values()) == {"length"}
        assert [rid for rid in first_token if rid not in ("blocker", "other")] == ["interactive", "batch0", "batch1"]
    finally:
        llm.close()
