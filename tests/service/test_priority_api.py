"""`priority` on /v1/completions and /v1/chat/completions through the official `openai` client
(`extra_body`), against real servers: one started with --scheduling-policy priority, and the
shared fcfs one, which refuses a priority other than 0 with a 400."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.service.conftest import MAIN_MODEL_NAME
from tests.service.server_process import ServerProcess

PROMPT = "The quick brown fox"
LONG_MODEL_LEN = 16384  # room for a request long enough to hold the one slot while others queue


@pytest.fixture(scope="module")
def priority_server(checkpoint, tmp_path_factory):
    """One request at a time, so the order requests run in is the order the rank's queue gives; no
    aging, so that order is by priority alone however many steps the blocker below runs while the
    queue forms (a tiny model steps thousands of times a second on a fast core: with the default
    256 steps a level, priority 10 caught up with a priority 0 that arrived a second later)."""
    path = checkpoint("tiny-llama", max_position_embeddings=LONG_MODEL_LEN)
    proc = ServerProcess(path, "--served-model-name", MAIN_MODEL_NAME, "--max-model-len",
                         str(LONG_MODEL_LEN), "--scheduling-policy", "priority", "--priority-aging-steps", "0", "--max-num-seqs", "1",
                         "--threads", "1", log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def greedy(**kwargs) -> dict:
    return {"model": MAIN_MODEL_NAME, "temperature": 0.0, **kwargs}


def test_priority_changes_no_tokens(priority_server):
    client = priority_server.openai()
    plain = client.completions.create(prompt=PROMPT, max_tokens=12, **greedy(extra_body={"ignore_eos": True}))
    for priority in (-7, 0, 9):
        out = client.completions.create(prompt=PROMPT, max_tokens=12,
                                        **greedy(extra_body={"ignore_eos": True, "priority": priority}))
        assert out.choices[0].text == plain.choices[0].text
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          **greedy(extra_body={"priority": 3}))
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0


def test_queued_priority_zero_runs_before_earlier_priority_ten(priority_server):
    client = priority_server.openai(timeout=300)
    # A long request holds the only sequence slot while the others queue behind it.
    blocker = client.completions.create(prompt=PROMPT, stream=True, max_tokens=LONG_MODEL_LEN - 16,
                                        **greedy(extra_body={"ignore_eos": True}))
    next(iter(blocker))
    tag = f"prio-{time.monotonic_ns()}"

    def submit(name: str, priority: int, chat: bool) -> None:
        extra = {"ignore_eos": True, "priority": priority}
        headers = {"X-Request-Id": f"{tag}-{name}"}
        if chat:
            client.chat.completions.create(messages=[{"role": "user", "content": name}], max_tokens=48,
                                           extra_headers=headers, **greedy(extra_body=extra))
        else:
            client.completions.create(prompt=f"{PROMPT} {name}", max_tokens=48, extra_headers=headers,
                                      **greedy(extra_body=extra))

    with ThreadPoolExecutor(4) as pool:
        futures = []
        for name, priority, chat in [("batch0", 10, False), ("batch1", 10, True), ("batch2", 10, False)]:
            futures.append(pool.submit(submit, name, priority, chat))
            wait_for_waiting(priority_server, len(futures))  # arrival order is submission order
        futures.append(pool.submit(submit, "interactive", 0, True))
        wait_for_waiting(priority_server, 4)
        blocker.close()  # the client leaves: the blocker is aborted and the queue drains
        for future in futures:
            future.result()
    # One at a time: the last to arrive, with the best priority, runs first; the rest in arrival
    # order. The order is the server's: when each request's first token came, from its log line.
    # (The order responses reach client threads is not: 48 tokens of a tiny model take a few ms,
    # less than a loaded machine's scheduling jitter.)
    assert order_of_first_tokens(priority_server, tag) == ["interactive", "batch0", "batch1", "batch2"]
    priority_server.wait_idle()


def order_of_first_tokens(server: ServerProcess, tag: str) -> list[str]:
    """The requests tagged `tag`, ordered by when the server sent each one's first token: the
    log line's wall time, less its latency, plus its time to first token."""
    events = [json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")]
    logged = {e["id"].removeprefix(f"{tag}-"): e for e in events
              if e.get("event") == "request" and str(e.get("id", "")).startswith(f"{tag}-")}
    assert len(logged) == 4, f"request log lines: {sorted(logged)}"
    first = {name: e["ts"] - e["latency_s"] + e["ttft_s"] for name, e in logged.items()}
    return sorted(first, key=first.__getitem__)


def wait_for_waiting(server: ServerProcess, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(server.metric("kvsentry_num_requests_waiting")) != count:
        assert time.monotonic() < deadline, f"the rank never reported {count} waiting requests"
        time.sleep(0.05)


def test_priority_out_of_range_or_mistyped_is_a_400(priority_server):
    client = priority_server.openai()
    for value in (2**40, "high", 1.5):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(prompt=PROMPT, max_tokens=2, **greedy(extra_body={"priority": value}))
        assert info.value.body["param"] == "priority"


def test_fcfs_server_refuses_a_priority(openai_client):
    # The shared server runs the default policy, fcfs: priority 0 is the only one it takes.
    out = openai_client.completions.create(prompt=PROMPT, max_tokens=2, **greedy(extra_body={"priority": 0}))
    assert out.choices[0].text is not None
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(prompt=PROMPT, max_tokens=2, **greedy(extra_body={"priority": 1}))
    assert info.value.status_code == 400
    assert info.value.body["param"] == "priority"
    assert "fcfs scheduling policy" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                              **greedy(extra_body={"priority": -1}))
    assert info.value.body["param"] == "priority"


def test_responses_take_a_priority(priority_server, openai_client):
    # vLLM's Responses request carries `priority` too: same rules as chat.
    client = priority_server.openai()
    args = dict(model=MAIN_MODEL_NAME, input="hi", max_output_tokens=8, temperature=0.0)
    plain = client.responses.create(**args)
    urgent = client.responses.create(**args, extra_body={"priority": -3})
    assert urgent.output_text == plain.output_text and urgent.usage.output_tokens > 0
    with pytest.raises(openai.BadRequestError) as info:  # the shared server runs fcfs
        openai_client.responses.create(**args, extra_body={"priority": 2})
    assert info.value.body["param"] == "priority"
    assert "fcfs scheduling policy" in info.value.body["message"]
