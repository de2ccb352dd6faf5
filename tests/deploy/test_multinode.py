"""Multi-node DP without a cluster: a leader `kvsentry serve` (front end + rank 0) and a
`--headless` worker (rank 1) started the way the multinode manifests start them, joined
over TCP on 127.0.0.1, serving requests across both ranks with expert parallelism."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.service.server_process import ServerProcess, free_port_run, kvsentry_command


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    model = checkpoint("tiny-deepseek-v3")
    logs = tmp_path_factory.mktemp("multinode")
    rpc = free_port_run()
    common = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
              "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc),
              "--kv-cache-memory", "64MiB", "--max-model-len", "256", "--dtype", "float32"]
    root = Path(__file__).resolve().parents[2]
    worker_log = open(logs / "worker.log", "wb")
    worker = subprocess.Popen([*kvsentry_command(), "serve", model, "--headless",
                               "--data-parallel-start-rank", "1", *common],
                              stdout=worker_log, stderr=subprocess.STDOUT, cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root)}, start_new_session=True)
    leader = ServerProcess(model, "--data-parallel-start-rank", "0", *common, log_dir=logs)
    try:
        leader.wait_ready(timeout=180)
        yield leader, worker
    finally:
        for proc in (leader.proc, worker):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in (leader.proc, worker):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        worker_log.close()


def test_requests_are_served_by_both_nodes(cluster, checkpoint):
    from engine import LLM, SamplingParams
    leader, worker = cluster
    client = leader.openai()
    prompts = [f"request number {i} says hello" for i in range(8)]
    texts = [client.completions.create(model=client.models.list().data[0].id, prompt=p, max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True}).choices[0].text
             for p in prompts]
    # Both ranks admitted real requests (the front end balances across them) ...
    admitted = {rank: sum(leader.metric("kvsentry_prefix_cache_queries_total", engine=rank))
                for rank in ("0", "1")}
    assert all(v > 0 for v in admitted.values()), admitted
    # ... and served text equals the single-process engine's greedy text.
    llm = LLM(checkpoint("tiny-deepseek-v3"), max_model_len=256, kv_cache_memory="16MiB", dtype="float32")
    reference = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert texts == [r.outputs[0].text for r in reference]
    assert worker.poll() is None, "the headless worker must still be running"
