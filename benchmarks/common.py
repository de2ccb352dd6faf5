"""What the offline benchmarks share: the bench-llama checkpoint and fixed random prompts."""
from __future__ import annotations

import random
import tempfile


def bench_checkpoint(path: str | None) -> str:
    """`path`, or a fresh bench-llama preset (hidden 256, 4 layers, vocab 32000) written for the run."""
    if path is not None:
        return path
    from engine.demo_checkpoint import write_preset
    path = tempfile.mkdtemp(prefix="bench-llama-")
    write_preset(path, "bench-llama")
    return path


def random_prompts(count: int, length: int, vocab: int = 32000, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(count)]
