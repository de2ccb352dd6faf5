"""Helpers for the data-parallel tests and benchmark: ports, prompts, references, driving a
DPEngineClient request by request, reading rank processes' CPU time, and looking inside
rank processes (a bitwise digest of each rank's KV cache; the old broken dummy batch).

Rank processes are *spawned*, so anything that builds a DP LLM must run under an
`if __name__ == "__main__":` guard (pytest is fine: it imports test modules).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import socket
import threading
import time
from pathlib import Path
from typing import Iterable
from unittest import mock

import torch

from engine.config import EngineConfig
from engine.dp import client as dp_client
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams

GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)


# -- ports ---------------------------------------------------------------------------------------

_handed_out: set[int] = set()
_port_lock = threading.Lock()


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int = 3, low: int = 20000, high: int = 32700) -> int:
    """First of `count` consecutive free TCP ports (the DP client binds rpc, rpc+1, rpc+2), below
    Linux's ephemeral range (32768+), where the OS may hand one to an outgoing connection meanwhile.

    Never hands out the same block twice in one process, so LLMs created back to back do
    not collide while the previous one's sockets linger.
    """
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    with _port_lock:
        for _ in range(2000):
            base = rng.randrange(low, high - count)
            block = range(base, base + count)
            if any(p in _handed_out for p in block):
                continue
            if all(_port_free(p) for p in block):
                _handed_out.update(block)
                return base
    raise RuntimeError(f"no {count} consecutive free ports found")


# -- prompts and references ----------------------------------------------------------------------

MIXED_LENGTHS = (1, 60, 5, 33, 17, 2, 48, 9)


def make_prompts(vocab: int, lengths: Iterable[int] = MIXED_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations (eos_token_id=None: the engine runs with ignore_eos)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


# -- driving the sync DP client request by request -----------------------------------------------

class Collected:
    """Token ids, logprobs and finish reason per request id, fed from engine.step() outputs."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}
        self.finish: dict[str, str] = {}

    def feed(self, outputs) -> None:
        for out in outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            self.logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.new_logprobs or [])
            if out.finish_reason is not None:
                self.finish[out.request_id] = out.finish_reason


def drain(engine, collected: Collected, ids: Iterable[str], timeout: float = 120.0) -> None:
    """Step the engine until every id in `ids` has finished (or fail after `timeout`)."""
    ids = set(ids)
    deadline = time.monotonic() + timeout
    while not ids <= collected.finish.keys():
        if time.monotonic() > deadline:
            missing = sorted(ids - collected.finish.keys())
            raise TimeoutError(f"requests did not finish within {timeout}s: {missing}")
        collected.feed(engine.step(timeout=0.5))


def wait_stats(engine, predicate, timeout: float = 30.0, what: str = "stats", sink=None) -> None:
    """Step (heartbeats carry stats) until predicate(engine.stats) holds; the outputs those steps
    bring go to `sink` where one is given (else they are dropped)."""
    deadline = time.monotonic() + timeout
    while not predicate(engine.stats):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}: {engine.stats}")
        outputs = engine.step(timeout=0.2)
        if sink is not None:
            sink(outputs)


def request(rid: str, prompt: list[int], params: SamplingParams = GREEDY16) -> EngineRequest:
    return EngineRequest(rid, list(prompt), params, arrival_time=time.time())


# -- processes -----------------------------------------------------------------------------------

def cpu_seconds(pids: Iterable[int]) -> float:
    """user + system CPU time of these processes and their threads (psutil)."""
    import psutil
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


# -- looking inside rank processes ---------------------------------------------------------------

def probed_rank(report_dir: str | None, legacy_dummy: bool, config: EngineConfig, rank: int,
                generation: int | None = 0) -> None:
    """A rank process's entry point for tests: the real `run_rank`, whose EngineCore also
    writes a report (steps, a digest of every byte of its KV cache, non-zero bytes in block 0)
    to `report_dir` each time it reports stats, and, with `legacy_dummy`, runs every dummy
    batch the old broken way (tests/engine/cache_probe.py)."""
    from engine.engine_core.engine_core import EngineCore
    from engine.dp import rank as rank_module
    from tests.engine.cache_probe import LegacyDummyCore, cache_digest, null_block_nonzero

    class ProbedCore(LegacyDummyCore if legacy_dummy else EngineCore):
        def stats(self):
            stats = super().stats()
            if report_dir is not None:
                report = {"steps": stats.steps, "digest": cache_digest(self.runner.kv_caches),
                          "null_block_nonzero": null_block_nonzero(self.runner.kv_caches)}
                path = report_path(report_dir, config, rank)
                scratch = path.with_suffix(".tmp")
                scratch.write_text(json.dumps(report))
                os.replace(scratch, path)  # a reader never sees half a report
            return stats

    rank_module.EngineCore = ProbedCore  # this spawned process only
    rank_module.run_rank(config, rank, generation)


@contextlib.contextmanager
def probed_ranks(report_dir: str | Path | None, legacy_dummy: bool = False):
    """DP clients created inside the block start their ranks through `probed_rank`. The
    client spawns `engine.dp.client.run_rank` by name; a spawned child unpickles the
    partial by importing this module."""
    target = functools.partial(probed_rank, None if report_dir is None else str(report_dir), legacy_dummy)
    with mock.patch.object(dp_client, "run_rank", target):
        yield


def report_path(report_dir: str | Path, config: EngineConfig, rank: int) -> Path:
    # The rpc port tells groups apart: free_port_block never hands a port out twice.
    return Path(report_dir) / f"port{config.parallel.data_parallel_rpc_port}-rank{rank}.json"


def cache_reports(engine, report_dir: str | Path, timeout: float = 30.0) -> dict[int, dict]:
    """rank -> its latest report, once every report is of the step count the client's stats
    show (so the digest is of the cache as of those stats). For a group that is not stepping."""
    deadline = time.monotonic() + timeout
    size = engine.config.parallel.data_parallel_size
    while True:
        reports = {}
        for rank in range(size):
            path = report_path(report_dir, engine.config, rank)
            stats = engine.stats.get(rank)
            if path.exists() and stats is not None:
                report = json.loads(path.read_text())
                if report["steps"] == stats.steps:
                    reports[rank] = report
        if len(reports) == size:
            return reports
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank reports never matched the stats: {engine.stats}")
        engine.step(timeout=0.2)
