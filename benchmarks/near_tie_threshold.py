"""How far bfloat16 moves the gap between the two most likely tokens: the measurement behind
judge.NEAR_TIE_LOGPROB.

    .venv/bin/python benchmarks/near_tie_threshold.py --model default [--vllm]

Takes serve.py's kind of sequences (random-id prompts from the vocabulary, each followed by its
float32 greedy continuation), scores every position with kvsentry in float32 and in bfloat16
(and, with --vllm, vLLM's CPU build in bfloat16, from the peer venv) through prompt_logprobs,
and at every position takes the float32 top-2 tokens a, b and the shift
(lp_bf16[a] - lp_bf16[b]) - (lp_f32[a] - lp_f32[b]). Two bf16 engines can pick different tokens
only where the float32 gap is below the larger of their shifts there; so the largest shift seen
bounds what a near-tie may be. Also counts the positions where a bf16 engine's best token is not
float32's, with the float32 gap at each. Writes its JSON into benchmarks/results/.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOP = 5  # top logprobs per position: the float32 top-2 are always among a bf16 engine's top-5 here


def vllm_worker(spec: dict) -> list:
    """In the peer venv: vLLM's offline LLM, prompt_logprobs of each sequence."""
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=1024, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": s} for s in spec["sequences"]],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=spec["top"]), use_tqdm=False)
    return [[None if p is None else {str(t): lp.logprob for t, lp in p.items()} for p in o.prompt_logprobs]
            for o in outs]


def vllm_logprobs(model: str, sequences: list[list[int]], threads: int) -> list:
    from servers import VLLM_DIR, vllm_cores
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec.write_text(json.dumps({"model": model, "dtype": "bfloat16", "sequences": sequences, "top": TOP}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_CACHE_ROOT": str(VLLM_DIR / "cache"), "VLLM_CPU_KVCACHE_SPACE": "2",
               "VLLM_CPU_OMP_THREADS_BIND": vllm_cores(threads)}
        if threads > 1:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        proc = subprocess.run([str(VLLM_DIR / "venv/bin/python"), __file__, "--worker", str(spec), str(out)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"FAIL: the vLLM worker exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        return [[None if p is None else {int(t): v for t, v in p.items()} for p in seq]
                for seq in json.loads(out.read_text())]


def kvsentry_logprobs(model: str, sequences: list[list[int]], engine_args: dict) -> list:
    """prompt_logprobs of each sequence, kvsentry on `engine_args` (dtype and path)."""
    from engine import LLM, SamplingParams
    with LLM(model, max_model_len=1024, enable_prefix_caching=False, **engine_args) as llm:
        outs = llm.generate(sequences, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP))
    return [[None if p is None else {t: lp.logprob for t, lp in p.items()} for p in o.prompt_logprobs] for o in outs]


def shifts(reference: list, other: list, start: int) -> tuple[list[float], list[float], int]:
    """Per position from `start`: the top-2 gap shift; the float32 gaps where `other`'s best token
    is not float32's; and how many positions lacked one of the float32 top-2 in `other`'s top."""
    moved, flips, unseen = [], [], 0
    for ref_seq, seq in zip(reference, other):
        for ref, pos in zip(ref_seq[start:], seq[start:]):
            (a, la), (b, lb) = sorted(ref.items(), key=lambda kv: -kv[1])[:2]
            if a not in pos or b not in pos:
                unseen += 1
                continue
            moved.append((pos[a] - pos[b]) - (la - lb))
            best = max(pos, key=pos.get)
            if best != a:
                flips.append(la - ref.get(best, float("-inf")))
    return moved, flips, unseen


def quantiles(values: list[float]) -> dict:
    ordered = sorted(abs(v) for v in values)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 5)  # noqa: E731
    return {"positions": len(ordered), "p50": pick(0.5), "p99": pick(0.99), "p999": pick(0.999),
            "max": round(ordered[-1], 5)}


def main() -> None:
    from common import DEFAULT_MODEL, bench_checkpoint, prompt_token_range, random_prompts
    from results import write_result
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm", action="store_true", help="also vLLM's CPU build in bfloat16 (the peer venv)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", help="write here instead of benchmarks/results/")
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent))
    import torch
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams
    from judge import EXACT_FLOAT32
    path = bench_checkpoint(args.model)
    low, vocab = prompt_token_range(path)
    prompts = random_prompts(args.requests, args.prompt_len, vocab=vocab, seed=args.seed, low=low)
    with LLM(path, max_model_len=1024, enable_prefix_caching=False, **EXACT_FLOAT32) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True))
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    reference = kvsentry_logprobs(path, sequences, EXACT_FLOAT32)
    engines = {"kvsentry bfloat16": kvsentry_logprobs(path, sequences, {"dtype": "bfloat16"})}  # as served
    if args.vllm:
        from servers import resolve_model
        engines["vLLM bfloat16"] = vllm_logprobs(resolve_model(args.model), sequences, args.threads)
    report = {}
    for name, logprobs in engines.items():
        moved, flips, unseen = shifts(reference, logprobs, 1)
        report[name] = {"top2_gap_shift": quantiles(moved), "positions_without_top2": unseen,
                        "argmax_flips": len(flips), "float32_gap_at_flips_max": round(max(flips, default=0.0), 5)}
        print(f"{name}: |shift of the float32 top-2 logprob gap| {report[name]['top2_gap_shift']}; "
              f"best token differs from float32's at {len(flips)} positions, float32 gap there at most "
              f"{report[name]['float32_gap_at_flips_max']}", flush=True)
    write_result("near-tie-threshold", {"args": vars(args), "engines": report}, args.json)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        Path(sys.argv[3]).write_text(json.dumps(vllm_worker(json.loads(Path(sys.argv[2]).read_text()))))
    else:
        main()
