"""The supervisor's decisions without processes: crash-loop backoff and limit, and the client
bookkeeping a rank's death relies on (re-queue what produced nothing, drop stale outputs)."""
from __future__ import annotations

import msgspec
import pytest

from engine.config import EngineConfig
from engine.dp.client import ClientState
from engine.dp.supervision import CrashLoop, silent_ranks
from engine.messages import EngineCoreOutput, EngineOutputs, EngineRequest, RankReady
from engine.sampling_params import SamplingParams


def test_backoff_doubles_per_rank_and_the_limit_is_a_crash_loop():
    loop = CrashLoop(max_restarts=5, window=100.0)
    assert loop.record(1, 0.0) == 0.0      # a rank's first death: respawned at once
    assert loop.record(0, 1.0) == 0.0      # another rank's first death too
    assert [loop.record(1, t) for t in (2.0, 3.0, 4.0)] == [1.0, 2.0, 4.0]
    assert loop.record(0, 5.0) is None     # the sixth death within the window
    assert "6 DP rank deaths within 100 s" in loop.verdict()


def test_deaths_older_than_the_window_are_forgotten():
    loop = CrashLoop(max_restarts=1, window=10.0)
    assert loop.record(0, 0.0) == 0.0
    assert loop.record(0, 20.0) == 0.0     # the first one left the window: no backoff, no loop
    assert loop.record(0, 25.0) is None


@pytest.fixture(scope="module")
def state(checkpoint) -> ClientState:
    config = EngineConfig.create(checkpoint("tiny-llama"), data_parallel_size=2, kv_cache_memory="4MiB",
                                 max_model_len=64)
    return ClientState(config)


def test_a_dead_rank_gives_back_its_unstarted_requests_and_its_stale_outputs_are_dropped(state):
    encode = msgspec.msgpack.Encoder().encode
    for rank, incarnation in ((0, 10), (1, 11)):
        state.handle(encode(RankReady(rank, 8, 100 + rank, {}, incarnation)))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for i in range(4):
        state.route(EngineRequest(f"r{i}", [1, 2, 3], params, arrival_time=float(i)), rank=i % 2)
    outputs, _ = state.handle(encode(EngineOutputs(1, [EngineCoreOutput("r1", 0, [7])], incarnation=11)))
    assert [o.request_id for o in outputs] == ["r1"]  # r1 has produced output, r3 has not
    state.rank_down(1)
    unstarted, started = state.take_requests({1})
    assert [r.request_id for r in unstarted] == ["r3"] and started == ["r1"]
    assert set(state.tracked) == {"r0", "r2"} and state.waiting[1] == state.running[1] == 0
    # The dead process's output still in flight reaches nobody, even for a re-queued request.
    state.route(unstarted[0], rank=0)
    late, _ = state.handle(encode(EngineOutputs(1, [EngineCoreOutput("r3", 0, [9])], incarnation=11)))
    assert late == [] and not state.tracked["r3"].started
    assert state.pick_rank() == 0  # only live ranks take requests


def test_silent_ranks_are_the_ready_ones_past_the_timeout_longest_silent_first():
    last_seen = {0: 100.0, 1: 90.0, 2: 97.5, 3: 80.0}
    # rank 3 is not ready (respawning): never judged; rank 2 is 2.5 s quiet, under the timeout
    assert silent_ranks(last_seen, {0, 1, 2}, now=100.0, timeout=3.0) == [(90.0, 1)]
    assert silent_ranks(last_seen, {0, 1, 2}, now=101.0, timeout=3.0) == [(90.0, 1), (97.5, 2)]
    assert silent_ranks(last_seen, set(), now=200.0, timeout=3.0) == []
