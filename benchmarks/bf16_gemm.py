"""The bf16 linears of a decode step: csrc/cpu_bf16_gemm.cpp's panel GEMM beside oneDNN.

    .venv/bin/python benchmarks/bf16_gemm.py            # the default model's shapes, 1 thread

Every layer's four GEMMs (q|k|v, o, gate|up, down) of the default model (SmolLM2-135M: hidden
576, intermediate 1536, 9 + 2 x 3 heads of 64), 30 layers of distinct random weights so that
each call reads its weight from memory as a decode step does, at 1 to 1024 rows. Prints the
best of 7 passes for each side, the weight bytes per second, the GFLOP/s and the ratio, and
exits 1 when the two sides' outputs differ by more than bf16 rounding of float32 sums
(they are computed with the same instruction; only the summation order may differ).
Needs a CPU with AVX512-BF16 (without it the engine uses oneDNN alone).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from common import best

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.ops import cpu_ops  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer



def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,1024")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_ops.available() or not torch.ops.kvsentry.bf16_gemm_supported():
        print("no AVX512-BF16 here (or no csrc build): nothing to compare")
        return 0
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(o, i, generator=g) * 0.05).bfloat16() for o, i in SHAPES] for _ in range(args.layers)]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights]
    panels = [[torch.ops.kvsentry.bf16_gemm_pack(w) for w in layer] for layer in weights]
    weight_bytes = sum(o * i for o, i in SHAPES) * 2 * args.layers
    print(f"{args.layers} layers x {SHAPES}, {weight_bytes / 1e6:.0f} MB of bf16 weights, {args.threads} thread(s)")
    print(f"{'rows':>5} {'oneDNN ms':>10} {'panels ms':>10} {'oneDNN GB/s':>12} {'panels GB/s':>12} "
          f"{'oneDNN GFLOP/s':>15} {'panels GFLOP/s':>15} {'speed-up':>9}")
    failed = False
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, i, generator=g).bfloat16() for _, i in SHAPES]

        def run_onednn():
            return [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
                    for layer in onednn for w, x in zip(layer, xs)]

        def run_panels():
            return [torch.ops.kvsentry.bf16_gemm(x, p, None, o)
                    for layer in panels for p, x, (o, _) in zip(layer, xs, SHAPES)]

        for a, b in zip(run_onednn()[:4], run_panels()[:4]):
            if not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2):
                print(f"FAIL: outputs differ at {rows} rows: max |diff| {(a.float() - b.float()).abs().max():.3g}")
                failed = True
        t_one, t_pan = best(run_onednn, 7), best(run_panels, 7)
        flop = 2 * rows * weight_bytes / 2
        print(f"{rows:>5} {t_one * 1e3:>10.2f} {t_pan * 1e3:>10.2f} {weight_bytes / t_one / 1e9:>12.1f} "
              f"{weight_bytes / t_pan / 1e9:>12.1f} {flop / t_one / 1e9:>15.0f} {flop / t_pan / 1e9:>15.0f} "
              f"{t_one / t_pan:>8.2f}x", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
