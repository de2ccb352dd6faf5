"""`kvsentry` command line."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsentry", description="kvsentry: a dummy-run-safe LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for one prompt (no server)")
    gen.add_argument("model", nargs="?", help="HF checkpoint directory (default: the built-in demo)")
    gen.add_argument("--prompt", default="Hello, my name is", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        from engine import LLM, SamplingParams
        from engine.demo_checkpoint import default_demo_path
        llm = LLM(args.model or str(default_demo_path()))
        out = llm.generate([args.prompt], SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
        print(out[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
