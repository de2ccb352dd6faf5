"""The README's performance table from serve.py's result JSONs: one row per dtype and workload,
kvsentry / vLLM output tokens/s at each concurrency, both servers' tokens/s, and the verdict.

    .venv/bin/python benchmarks/results_table.py benchmarks/results/serve-bfloat16_*.json \
        benchmarks/results/serve-float32_*.json > benchmarks/results/README-table.md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def verdict_line(verdict: dict) -> str:
    line = f"{verdict['identical']}/{verdict['requests']} identical"
    if verdict["dtype"] != "float32":
        line += (f", {verdict['near_tie']} near-ties, {verdict['not_near_tie']} not near-ties "
                 f"(threshold {verdict['near_tie_threshold_logprob']} float32 logprob)")
        if "peer_rounding" in verdict:  # judged since 2026-12-06
            line += f", {verdict['peer_rounding']} of them the peer's rounding"
    elif verdict["not_near_tie"]:
        line += f", {verdict['not_near_tie']} differ"
    return f"{'PASS' if verdict['passed'] else 'FAIL'}: {line}"


def table(results: list[tuple[str, dict]]) -> str:
    first = results[0][1]
    stamp = first["provenance"]
    commits = sorted({r["provenance"]["commit"] for _, r in results})
    args = first["args"]
    lines = [f"# serve.py: kvsentry / vLLM on {stamp['machine']} ({stamp['cpu']}, {stamp['cores']} cores)", "",
             f"- date: {', '.join(sorted({r['provenance']['date'] for _, r in results}))} (UTC)",
             f"- commit measured: {', '.join(commits)}",
             f"- peer: {first.get('peer', '?')}; model: the default (SmolLM2-135M-Instruct; kvsentry serves its "
             f"Q4_1 GGUF, vLLM the same weights dequantized)",
             f"- method: `benchmarks/serve.py --start-kvsentry default --start-vllm default --dtype DTYPE "
             f"--threads {args['threads']} --concurrency {','.join(map(str, args['concurrency']))}`: streamed greedy "
             f"ignore_eos completions of {args['output_len']} tokens, token-id prompts (fixed {args['input_len']}, "
             f"mixed {args['mixed_range'][0]}..{args['mixed_range'][1]}), fresh prompts per level, the servers "
             f"alternating level by level (each alone, started, warmed up, measured, stopped), "
             f"{args['threads']} compute thread each, prefix caching off on both; token ids judged by "
             f"benchmarks/judge.py", "",
             "| dtype | workload | concurrency | kvsentry tok/s | vLLM tok/s | kvsentry / vLLM |",
             "|---|---|---|---|---|---|"]
    for label, result in results:
        rows = {(r["server"], r["workload"], r["concurrency"]): r for r in result["rows"]}
        workloads = list(dict.fromkeys(r["workload"] for r in result["rows"]))
        for workload in workloads:
            levels = sorted(c for s, w, c in rows if s == "kvsentry" and w == workload)
            ours = [rows[("kvsentry", workload, c)]["output_tok_s"] for c in levels]
            theirs = [rows.get(("vllm", workload, c), {}).get("output_tok_s") for c in levels]
            ratio = [f"{a / b:.2f}x" if b else "-" for a, b in zip(ours, theirs)]
            lines.append(f"| {label} | {workload} | {' / '.join(map(str, levels))} | {' / '.join(map(str, ours))} | "
                         f"{' / '.join(str(t) for t in theirs)} | **{' / '.join(ratio)}** |")
    lines.append("")
    for label, result in results:
        name = Path(result["_path"]).name
        lines.append(f"- {label}: {verdict_line(result['verdict'])} (`{name}`)")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="serve.py result JSONs, one per dtype")
    args = parser.parse_args()
    results = []
    for path in args.results:
        data = json.loads(Path(path).read_text())
        data["_path"] = path
        results.append((data["args"]["dtype"], data))
    print(table(results), end="")


if __name__ == "__main__":
    main()
