"""The bf16 linears of a decode step: csrc/cpu/cpu_bf16_gemm.cpp's panel GEMM beside oneDNN.

    .venv/bin/python benchmarks/bf16_gemm.py            # the default model's shapes, 1 thread

Every layer's four GEMMs (q|k|v, o, gate|up, down) of the default model (SmolLM2-135M: hidden
576, intermediate 1536, 9 + 2 x 3 heads of 64), 30 layers of distinct random weights so that
each call reads its weight from memory as a decode step does, at 1 to 1024 rows. Prints the
best of 7 passes for each side (oneDNN and every panel kernel this CPU runs: AMX tiles,
vdpbf16ps, float32 FMAs on widened bf16), the weight bytes per second, the GFLOP/s and the
ratio, and exits 1 when the two sides' outputs differ by more than bf16 rounding of float32
sums (only the summation order may differ).

    .venv/bin/python benchmarks/bf16_gemm.py --quant   # the weights as the default model holds them

--quant: the weights are GGUF Q4_1 blocks (gguf's reference quantizer), the panels those blocks
(csrc/cpu/cpu_quant_panels.h) and oneDNN the dequantized bf16 weight; GB/s counts the blocks' bytes.
On AMX CPUs with AVX512-VBMI also "amx_rows": the AMX tiles on the same blocks in the rows layout
(quant_rows_pack), which the engine packs there.
Needs a CPU with AVX-512F.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from common import best

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.ops import registry  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer


def quantized(weights: list[list[torch.Tensor]]) -> tuple[list, list, list | None]:
    """Each weight as Q4_1 blocks: (the dequantized bf16 weights, the blocks as panels, the blocks
    in the rows layout where the CPU runs it, else None)."""
    import gguf
    import numpy as np
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    rows_here = bool(registry.op("quant_rows_supported")())
    dense, blocks, rows = [], [], []
    for layer in weights:
        dense.append([]), blocks.append([]), rows.append([])
        for w in layer:
            raw = torch.from_numpy(np.ascontiguousarray(gguf.quantize(w.float().numpy(), q4_1)))
            values = np.array(gguf.dequantize(raw.numpy(), q4_1), dtype=np.float32).reshape(w.shape)
            dense[-1].append(torch.from_numpy(values).bfloat16())
            blocks[-1].append(registry.op("quant_panels_pack")(raw, int(q4_1), w.shape[1]))
            if rows_here:
                rows[-1].append(registry.op("quant_rows_pack")(raw, int(q4_1), w.shape[1]))
    return dense, blocks, rows if rows_here else None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,1024")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quant", action="store_true", help="Q4_1 blocks as the panels (the default model's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # The debug flavour of the library: its bf16_gemm_with runs each kernel by name.
    debug = registry.debug_ops()
    if not registry.available("bf16_gemm", "cpu") or not registry.op("bf16_gemm_supported")():
        print("no AVX-512F here (or no csrc build): nothing to compare")
        return 0
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(o, i, generator=g) * 0.05).bfloat16() for o, i in SHAPES] for _ in range(args.layers)]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights]
    panels = [[registry.op("bf16_gemm_pack")(w) for w in layer] for layer in weights]
    weight_bytes = sum(o * i for o, i in SHAPES) * 2 * args.layers
    rows_layout = None
    if args.quant:
        weights, panels, rows_layout = quantized(weights)
        onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights]
        weight_bytes = sum(p.numel() for layer in panels for p in layer)
    kernels = list(registry.op("bf16_gemm_kernels")())
    if rows_layout is not None:
        kernels.insert(0, "amx_rows")  # the AMX tiles on the rows layout (what the engine packs here)
    print(f"{args.layers} layers x {SHAPES}, {weight_bytes / 1e6:.0f} MB of {'Q4_1' if args.quant else 'bf16'} weights, {args.threads} thread(s), "
          f"panel kernels here: {', '.join(kernels)}")
    header = f"{'rows':>5} {'oneDNN ms':>10} {'GB/s':>6} {'GFLOP/s':>8}"
    for kernel in kernels:
        header += f" | {kernel + ' ms':>15} {'GB/s':>6} {'GFLOP/s':>8} {'speed-up':>8}"
    print(header)
    failed = False
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, i, generator=g).bfloat16() for _, i in SHAPES]

        def run_onednn():
            return [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
                    for layer in onednn for w, x in zip(layer, xs)]

        def run_panels(kernel):
            if kernel == "amx_rows":
                return [debug.bf16_gemm_with(x, p, None, o, "amx")
                        for layer in rows_layout for p, x, (o, _) in zip(layer, xs, SHAPES)]
            return [debug.bf16_gemm_with(x, p, None, o, kernel)
                    for layer in panels for p, x, (o, _) in zip(layer, xs, SHAPES)]

        flop = 2 * rows * sum(o * i for o, i in SHAPES) * args.layers
        t_one = best(run_onednn, 7)
        line = f"{rows:>5} {t_one * 1e3:>10.2f} {weight_bytes / t_one / 1e9:>6.1f} {flop / t_one / 1e9:>8.0f}"
        for kernel in kernels:
            for a, b in zip(run_onednn()[:4], run_panels(kernel)[:4]):
                if not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2):
                    print(f"FAIL: {kernel} differs from oneDNN at {rows} rows: "
                          f"max |diff| {(a.float() - b.float()).abs().max():.3g}")
                    failed = True
            t = best(lambda: run_panels(kernel), 7)
            line += (f" | {t * 1e3:>15.2f} {weight_bytes / t / 1e9:>6.1f} {flop / t / 1e9:>8.0f} "
                     f"{t_one / t:>7.2f}x")
        print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
