"""What the benchmarks share: the bench-llama checkpoint or the real default model, seeded random
prompts, and the check that two runs of kvsentry give identical greedy outputs. Two engines'
outputs are judged by judge.py (float32 identical, bfloat16 divergences only at near-ties)."""
from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

DEFAULT_MODEL = "default"  # --model value naming the default model: SmolLM2-135M-Instruct, Q4_1 GGUF
DTYPES = ("float32", "bfloat16")
OFFLINE_WARMUP_SEED = 1_000_000  # offline benchmarks' warm-up prompts: apart from the timed runs' seeds


def best(fn: Callable[[], object], repeats: int = 5) -> float:
    """Seconds of the fastest of `repeats` calls of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def workload_parser() -> argparse.ArgumentParser:
    """The flags every offline benchmark shares: checkpoint and the fixed workload."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help=f"checkpoint dir, .gguf file, or {DEFAULT_MODEL!r} for the default model "
                        "(SmolLM2-135M-Instruct, Q4_1 GGUF); none given: write the bench-llama preset")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    return parser


def bench_checkpoint(path: str | None) -> str:
    """`path`; the default model's GGUF file for "default"; none given: a fresh bench-llama preset
    (hidden 256, 4 layers, vocab 32000) written for the run."""
    if path == DEFAULT_MODEL:
        from engine.gguf.default_model import default_model_path
        return default_model_path()
    if path is not None:
        return path
    from service.demo.checkpoint import write_preset
    path = tempfile.mkdtemp(prefix="bench-llama-")
    write_preset(path, "bench-llama")
    return path


def random_prompts(count: int, length: int, vocab: int = 32000, seed: int = 0, low: int = 5) -> list[list[int]]:
    """Token ids drawn uniformly from [low, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(count)]


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


# -- the real default model -----------------------------------------------------------------------
def load_transformers(path: str, dtype: str = "float32"):
    """transformers' model of a checkpoint dir or a .gguf file (dequantized at load), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM
    source = Path(path)
    where = dict(gguf_file=source.name) if source.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(source.parent if where else source, dtype=getattr(torch, dtype),
                                                 **where)
    return model.eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    source = Path(path)
    if source.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    return AutoTokenizer.from_pretrained(source)


def prompt_token_range(path: str) -> tuple[int, int]:
    """Token ids a random prompt draws from: the whole vocabulary above the special and added tokens."""
    tokenizer = load_tokenizer(path)
    return max([*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder], default=-1) + 1, len(tokenizer)


def hf_checkpoint(path: str) -> str:
    """A .gguf file dequantized once (by transformers, float32) into a safetensors checkpoint dir with
    its tokenizer, cached under the kvsentry cache dir; any other path is returned as it is. Peers that
    cannot run the GGUF (vLLM's CPU build does not start on it) serve this dir: the weights kvsentry
    dequantizes from the file, bit for bit."""
    source = Path(path)
    if source.suffix != ".gguf":
        return path
    from engine import envs
    stat = source.stat()
    tag = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    target = envs.cache_dir() / "hf" / f"{source.stem}-{tag}"
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{source.stem}-", dir=target.parent))
    model = load_transformers(path, "float32")
    model.hf_quantizer = None  # the weights are dequantized already; this lets save_pretrained write them
    del model.config.quantization_config
    model.save_pretrained(scratch)
    load_tokenizer(path).save_pretrained(scratch)
    try:
        scratch.rename(target)
    except OSError:  # another run wrote it first
        shutil.rmtree(scratch, ignore_errors=True)
    return str(target)
