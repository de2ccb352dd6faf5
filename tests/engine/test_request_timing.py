"""The times a rank stamps on a request (RequestTiming, which traces report): sent once per
sample, with its finishing output, in order, and only as far as the sample got."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine_core.engine_core import EngineCore
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams

PROMPT = [0] + [(13 * j) % 500 + 5 for j in range(20)]


@pytest.fixture(scope="module")
def engine(checkpoint):
    # One running request at a time, so a second one waits (and can be aborted while it does).
    return EngineCore(EngineConfig.create(checkpoint("tiny-llama"), num_gpu_blocks=64, block_size=16,
                                          max_model_len=128, max_num_seqs=1))


def test_each_finished_sample_carries_its_times_in_order(engine):
    engine.add_request(EngineRequest("a", PROMPT, SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=4,
                                                                 ignore_eos=True)))
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    timed = [o for o in outputs if o.timing is not None]
    assert sorted(o.index for o in timed) == [0, 1]
    assert all(o.finish_reason == "length" for o in timed), "only finishing outputs carry times"
    for out in timed:
        t = out.timing
        assert t.rank == 0
        assert 0 <= t.scheduled < t.first_token < t.last_token
    # Sample 1 waited for sample 0's prompt (and max_num_seqs=1): it was scheduled later.
    by_index = {o.index: o.timing for o in timed}
    assert by_index[1].scheduled > by_index[0].scheduled


def test_an_aborted_waiting_sample_has_no_scheduling_times(engine):
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request(EngineRequest("running", PROMPT, params))
    engine.add_request(EngineRequest("waiting", PROMPT[:10], params))
    engine.step()
    engine.step()
    engine.abort(["running", "waiting"])
    timings = {o.request_id: o.timing for o in engine.step()}
    assert timings["waiting"].scheduled is None and timings["waiting"].first_token is None
    assert timings["running"].scheduled is not None and timings["running"].first_token is not None
    assert not engine.has_unfinished
