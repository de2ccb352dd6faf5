"""What the offline benchmarks share: the bench-llama checkpoint and fixed random prompts."""
from __future__ import annotations

import argparse
import random
import tempfile


def workload_parser() -> argparse.ArgumentParser:
    """The flags every offline benchmark shares: checkpoint and the fixed workload."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="checkpoint dir (default: write the bench-llama preset)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    return parser


def bench_checkpoint(path: str | None) -> str:
    """`path`, or a fresh bench-llama preset (hidden 256, 4 layers, vocab 32000) written for the run."""
    if path is not None:
        return path
    from service.demo.checkpoint import write_preset
    path = tempfile.mkdtemp(prefix="bench-llama-")
    write_preset(path, "bench-llama")
    return path


def random_prompts(count: int, length: int, vocab: int = 32000, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(count)]
