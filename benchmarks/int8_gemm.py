"""The GGUF linears of a decode step with int8 activations (csrc/cpu/cpu_int8_gemm.cpp) beside
the bf16 panels on the same Q4_1 blocks (csrc/cpu/cpu_quant_panels.h through bf16_gemm).

    .venv/bin/python benchmarks/int8_gemm.py               # the default model's shapes, 1 thread

Every layer's four GEMMs (q|k|v, o, gate|up, down) of the default model (SmolLM2-135M: hidden
576, intermediate 1536), 30 layers of distinct random weights quantized to Q4_1 by gguf (ggml's
reference quantizer), so that each call reads its blocks from memory as a decode step does; and
the Q8_0 LM head (49152 x 576). At 1, 8, 32 and 64 rows (and more with --rows), the best of 7
passes of each side: ms, the blocks' GB/s, GMAC/s, and the ratio. Writes a JSON to
benchmarks/results/. Needs AVX512-VNNI (and AVX-512F for the bf16 side).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from common import best
from results import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.ops import registry  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
HEAD = (49152, 576)


def blocks(shape: tuple[int, int], qtype, seed: int) -> torch.Tensor:
    import gguf
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    return torch.from_numpy(np.ascontiguousarray(gguf.quantize(values, qtype)))


def main() -> int:
    import gguf
    Q = gguf.GGMLQuantizationType
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the JSON here instead of benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not registry.available("int8_gemm", "cpu"):
        print("int8_gemm does not run here (no AVX512-VNNI)")
        return 1
    pack8, gemm8 = registry.op("int8_gemm_pack"), registry.op("int8_gemm")
    quant_bf16 = registry.op("quant_panels_supported")(torch.bfloat16)
    raws = [[blocks(s, Q.Q4_1, 100 * layer + i) for i, s in enumerate(SHAPES)] for layer in range(args.layers)]
    int8 = [[pack8(raw, int(Q.Q4_1), s[1]) for raw, s in zip(layer, SHAPES)] for layer in raws]
    bf16 = [[registry.op("quant_panels_pack")(raw, int(Q.Q4_1), s[1]) for raw, s in zip(layer, SHAPES)]
            for layer in raws] if quant_bf16 else None
    head_raw = blocks(HEAD, Q.Q8_0, 7)
    head8 = pack8(head_raw, int(Q.Q8_0), HEAD[1])
    head16 = registry.op("quant_panels_pack")(head_raw, int(Q.Q8_0), HEAD[1]) if quant_bf16 else None
    layer_bytes = sum(raw.numel() for layer in raws for raw in layer)
    layer_macs = args.layers * sum(o * i for o, i in SHAPES)
    results = []
    for m in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(m, s[1]) for s in SHAPES]
        xb = [x.bfloat16() for x in xs]
        xh = torch.randn(m, HEAD[1])
        row = {"rows": m}
        t8 = best(lambda: [gemm8(x, w, None, s[0]) for layer in int8 for x, w, s in zip(xs, layer, SHAPES)], 7)
        h8 = best(lambda: gemm8(xh, head8, None, HEAD[0]), 7)
        row.update(int8_layers_ms=round(t8 * 1e3, 3), int8_head_ms=round(h8 * 1e3, 3),
                   int8_layers_gb_s=round(layer_bytes / t8 / 1e9, 2),
                   int8_layers_gmac_s=round(m * layer_macs / t8 / 1e9, 1))
        line = (f"{m:5d} rows: int8 layers {t8 * 1e3:7.2f} ms ({layer_bytes / t8 / 1e9:5.1f} GB/s, "
                f"{m * layer_macs / t8 / 1e9:6.1f} GMAC/s), head {h8 * 1e3:6.2f} ms")
        if bf16 is not None:
            tb = best(lambda: [registry.op("bf16_gemm")(x, w, None, s[0])
                               for layer in bf16 for x, w, s in zip(xb, layer, SHAPES)], 7)
            hb = best(lambda: registry.op("bf16_gemm")(xh.bfloat16(), head16, None, HEAD[0]), 7)
            row.update(bf16_layers_ms=round(tb * 1e3, 3), bf16_head_ms=round(hb * 1e3, 3),
                       layers_speedup=round(tb / t8, 3), head_speedup=round(hb / h8, 3))
            line += f" | bf16 panels on the blocks {tb * 1e3:7.2f} ms, head {hb * 1e3:6.2f} ms | {tb / t8:.2f}x, {hb / h8:.2f}x"
        print(line, flush=True)
        results.append(row)
    write_result("int8-gemm", {"args": vars(args), "threads": args.threads, "layer_block_bytes": layer_bytes,
                               "layer_macs_per_row": layer_macs, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
