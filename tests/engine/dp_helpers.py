"""Helpers for the data-parallel tests and benchmark: ports, prompts, references, driving a
DPEngineClient request by request, and reading rank processes' CPU time.

Rank processes are *spawned*, so anything that builds a DP LLM must run under an
`if __name__ == "__main__":` guard (pytest is fine: it imports test modules).
"""
from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
from typing import Iterable

import torch

from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams

GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
DIGEST_ENV = "KVSENTRY_TEST_CACHE_DIGEST"


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


def free_port_block(count: int = 3, low: int = 20000, high: int = 60000) -> int:
    """First of `count` consecutive free TCP ports (the DP client binds rpc, rpc+1, rpc+2).

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


def wait_stats(engine, predicate, timeout: float = 30.0, what: str = "stats") -> None:
    """Step (heartbeats carry stats) until predicate(engine.stats) holds."""
    deadline = time.monotonic() + timeout
    while not predicate(engine.stats):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}: {engine.stats}")
        engine.step(timeout=0.2)


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


@contextlib.contextmanager
def env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
