"""DP=2 over HTTP with a MoE model (ranks in lockstep, expert parallel): the text equals a
single-rank offline run; killing a rank fails its streaming request and the group re-forms."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.service.server_process import ServerProcess

PROMPTS = ["Hello, my name is", "the model of a server", "1 2 3", "key value cache"]


@pytest.fixture(scope="module")
def dp_server(moe_path, tmp_path_factory):
    proc = ServerProcess(moe_path, "--data-parallel-size", "2", "--max-model-len", "512",
                         "--served-model-name", "moe", "--threads", "1",
                         "--enable-fault-injection", "--nan-policy", "fail",
                         log_dir=tmp_path_factory.mktemp("dp-logs"), api_key=None)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_dp2_greedy_text_matches_single_rank_offline_llm(dp_server, moe_path):
    from engine import LLM, SamplingParams
    client = dp_server.openai()
    # Separate concurrent-ish requests, so the router spreads them over both ranks.
    http_texts = [client.completions.create(model="moe", prompt=p, max_tokens=16, temperature=0.0,
                                            extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    batched = client.completions.create(model="moe", prompt=PROMPTS, max_tokens=16, temperature=0.0,
                                        extra_body={"ignore_eos": True})
    with LLM(moe_path, kv_cache_memory="64MiB", max_model_len=512, dtype="float32") as llm:
        offline = [o.outputs[0].text for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))]
    assert http_texts == offline
    assert [c.text for c in sorted(batched.choices, key=lambda c: c.index)] == offline
    steps = dp_server.metric("kvsentry_engine_steps_total")
    assert len(steps) == 2 and all(s > 0 for s in steps), "both ranks stepped"


def test_dp2_chat_streaming(dp_server):
    client = dp_server.openai()
    chunks = list(client.chat.completions.create(model="moe", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, stream=True, n=2, seed=1))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    dp_server.wait_idle()


def test_nan_policy_fail_takes_the_server_out_of_rotation(dp_server):
    log = [json.loads(line) for line in dp_server.log_text().splitlines() if line.startswith("{")]
    num_blocks = next(e["num_blocks"] for e in log if e.get("event") == "engine_ready")
    # A block no request will be given soon, found by the rolling sweep within a few dozen steps.
    fault = {"rank": 0, "kind": "nan", "layer": 0, "block": num_blocks - 1, "target": "latent"}
    response = httpx.post(f"{dp_server.url}/debug/faults", json=fault, timeout=10)
    assert response.status_code == 200, response.text
    assert httpx.post(f"{dp_server.url}/debug/faults", json={**fault, "rank": 5}, timeout=10).status_code == 400
    assert httpx.get(f"{dp_server.url}/ready").status_code == 200
    client = dp_server.openai()
    deadline = time.monotonic() + 60
    while (ready := httpx.get(f"{dp_server.url}/ready")).status_code == 200:
        assert time.monotonic() < deadline, "the NaN policy never tripped"
        client.completions.create(model="moe", prompt="x", max_tokens=64, extra_body={"ignore_eos": True})
    assert ready.status_code == 503 and "NaN policy" in ready.json()["error"]["message"]
    assert httpx.get(f"{dp_server.url}/health").status_code == 200  # out of rotation, not restarted


def test_killing_a_rank_fails_its_stream_and_the_group_re_forms(dp_server):
    """SIGKILL from outside (as the OOM killer would) to a rank under a streaming request: the
    stream ends with finish_reason "error" and an error event, the server stays healthy, the
    lockstep group re-forms with a respawned rank and serves again (tests/service/
    test_rank_faults.py covers the load, the re-queue and the outputs)."""
    ranks = dp_server.rank_pids()
    assert len(ranks) == 2, ranks
    body = {"model": "moe", "prompt": "x", "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{dp_server.url}/v1/completions", json={**body, "stream": True}) as response:
            lines = (line for line in response.iter_lines() if line)
            assert next(lines).startswith("data: {")
            os.kill(ranks[1], signal.SIGKILL)
            killed = time.monotonic()
            events = []
            for line in lines:
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
            assert time.monotonic() - killed < 15, "the stream hung after a rank died"
    assert events[-1] == "[DONE]"
    assert "error" in events[-2], events[-3:]
    assert events[-3]["choices"][0]["finish_reason"] == "error"
    assert httpx.get(f"{dp_server.url}/health", timeout=5).status_code == 200
    dp_server.wait_ready(timeout=120)
    assert dp_server.proc.poll() is None
    new_ranks = dp_server.rank_pids()
    assert len(new_ranks) == 2 and ranks[0] in new_ranks and ranks[1] not in new_ranks, (ranks, new_ranks)
    text = dp_server.openai().completions.create(model="moe", prompt="1 2 3", max_tokens=4).choices[0].text
    assert isinstance(text, str)
    log = [json.loads(line) for line in dp_server.log_text().splitlines() if line.startswith("{")]
    assert any("re-formed" in e.get("msg", "") for e in log)
