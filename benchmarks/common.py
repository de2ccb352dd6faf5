"""What the benchmarks share: the bench-llama checkpoint, seeded random prompts, and the
check that two engines' greedy outputs are identical (a speed ratio between engines that
computed different things is not a comparison)."""
from __future__ import annotations

import argparse
import random
import tempfile
from collections.abc import Sequence


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


class OutputMismatch(SystemExit):
    """Outputs that must be equal are not: uncaught, it prints its message and exits with status 1."""


def require_identical(what: str, ours: Sequence, theirs: Sequence, names: tuple[str, str],
                      labels: Sequence[str] | None = None) -> str:
    """A one-line verdict when `ours[i] == theirs[i]` for every i; otherwise raise OutputMismatch
    naming the first differing items and where they diverge. Items are token-id lists or texts."""
    labels = list(labels) if labels is not None else [f"request {i}" for i in range(len(ours))]
    if len(ours) != len(theirs):
        raise OutputMismatch(f"FAIL {what}: {names[0]} gave {len(ours)} outputs, {names[1]} {len(theirs)}")
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a is None or b is None or list(a) != list(b)]
    if not differ:
        return f"{what}: outputs identical for {len(ours)}/{len(ours)} ({names[0]} vs {names[1]})"
    lines = [f"FAIL {what}: outputs differ for {len(differ)}/{len(ours)} ({names[0]} vs {names[1]}); "
             f"these must be equal, so the timings above compare different work"]
    for i in differ[:5]:
        a, b = ours[i], theirs[i]
        if a is None or b is None:
            lines.append(f"  {labels[i]}: {names[0]} {'no output' if a is None else 'ok'}, "
                         f"{names[1]} {'no output' if b is None else 'ok'}")
            continue
        at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lines.append(f"  {labels[i]}: first difference at item {at} of {len(a)}/{len(b)}: "
                     f"{names[0]} {a[at:at + 4]!r} vs {names[1]} {b[at:at + 4]!r}")
    if len(differ) > 5:
        lines.append(f"  ... and {len(differ) - 5} more")
    raise OutputMismatch("\n".join(lines))
