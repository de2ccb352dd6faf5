"""Plot serve.py's results: output tokens/s against concurrency, kvsentry beside vLLM, one line
per server and dtype, one panel per workload, each kvsentry point labelled with its ratio to vLLM.

    .venv/bin/python benchmarks/plot_serve.py --run bfloat16=benchmarks/results/serve-bfloat16_...json \
        --run float32=benchmarks/results/serve-float32_...json --out benchmarks/results/serve_throughput.png

Each --run is LABEL=PATH, PATH a JSON file serve.py wrote (benchmarks/results/serve-*.json). Needs matplotlib
(`pip install matplotlib`, the `bench` extra): only this script uses it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

COLORS = {"bfloat16": "tab:blue", "float32": "tab:orange"}
STYLES = {"kvsentry": "-", "vllm": "--"}


def load(runs: list[str]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for run in runs:
        label, _, path = run.partition("=")
        if not path:
            raise SystemExit(f"--run {run!r}: expected LABEL=PATH")
        data = json.loads(Path(path).read_text())
        out[label] = data["rows"] if isinstance(data, dict) else data  # older files: the rows alone
    return out


def series(rows: list[dict], server: str, workload: str) -> tuple[list[int], list[float]]:
    points = sorted((r["concurrency"], r["output_tok_s"]) for r in rows
                    if r["server"] == server and r["workload"] == workload and not r.get("errors"))
    return [c for c, _ in points], [t for _, t in points]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, help="LABEL=PATH of a JSON file serve.py wrote")
    parser.add_argument("--out", default="benchmarks/results/serve_throughput.png")
    parser.add_argument("--title", default="SmolLM2-135M-Instruct, 1 compute thread each, greedy, 64 new tokens")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load(args.run)
    workloads = sorted({r["workload"] for rows in runs.values() for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for label, rows in runs.items():
            color = COLORS.get(label)
            peer = dict(zip(*series(rows, "vllm", workload)))
            for server in ("kvsentry", "vllm"):
                xs, ys = series(rows, server, workload)
                if not xs:
                    continue
                ax.plot(xs, ys, STYLES.get(server, ":"), marker="o", color=color, label=f"{server} {label}")
                if server == "kvsentry":
                    for x, y in zip(xs, ys):
                        if peer.get(x):
                            ax.annotate(f"{y / peer[x]:.2f}x", (x, y), textcoords="offset points", xytext=(4, 6),
                                        fontsize=8, color=color)
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for rows in runs.values() for r in rows if r["workload"] == workload})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("output tokens/s")
        ax.set_title(workload)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
