"""The GGUF linears of a decode step with int8 activations (csrc/cpu/cpu_int8_gemm.cpp) beside
the bf16 panels on the same Q4_1 (or Q8_0) blocks (csrc/cpu/cpu_quant_panels.h through bf16_gemm).

    .venv/bin/python benchmarks/int8_gemm.py               # the default model's shapes, 1 thread
    .venv/bin/python benchmarks/int8_gemm.py --shapes tinyllama --layers 4 --format q4_k --rows 1,8

Every layer's four GEMMs (q|k|v, o, gate|up, down) of the default model (SmolLM2-135M: hidden
576, intermediate 1536), 30 layers of distinct random Q4_1 blocks, so that each call reads its
blocks from memory as a decode step does; and the Q8_0 LM head (49152 x hidden). At 1, 8, 32
and 64 rows (and more with --rows), the best of 7 passes of each side: ms, the blocks' GB/s,
GMAC/s, and the ratio. Writes a JSON to benchmarks/results/. Needs AVX512-VNNI (and AVX-512F
for the bf16 side).

--format picks the layers' GGML format (q4_0, q4_1, q5_0, q8_0, q4_k, q6_k; the bf16 side runs
for q4_1 and q8_0, the formats its panels take). The K-quants need rows of K in whole
super-blocks of 256, which the default model's 576 is not: --shapes tinyllama takes the 1B-class
model's (hidden 2048, 32 query and 4 KV heads of 64, intermediate 5632). Blocks are random bytes
with float16 scales of a weight's size (the speed does not depend on the values).
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

# (out, in) per layer: q|k|v, o, gate|up, down.
MODEL_SHAPES = {"smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
                "tinyllama": [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]}
VOCAB = 49152
FORMATS = ("q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q6_k")
# Where each format's float16 scales (and minima) sit in its block.
SCALE_BYTES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def blocks(shape: tuple[int, int], qtype, seed: int) -> torch.Tensor:
    """[out, in / values * block bytes] uint8: random bytes with float16 scales (and minima) of a
    weight's size at their places in each block (every other bit pattern is a valid block)."""
    import gguf
    n, k = shape
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    for at in SCALE_BYTES[qtype.name]:
        scale = (np.abs(rng.standard_normal((n, k // values, 1))) * 1e-3).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def main() -> int:
    import gguf
    Q = gguf.GGMLQuantizationType
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--format", choices=FORMATS, default="q4_1", help="the layers' GGML format")
    parser.add_argument("--shapes", choices=sorted(MODEL_SHAPES), default="smollm2")
    parser.add_argument("--json", help="write the JSON here instead of benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not registry.available("int8_gemm", "cpu"):
        print("int8_gemm does not run here (no AVX512-VNNI)")
        return 1
    pack8, gemm8 = registry.op("int8_gemm_pack"), registry.op("int8_gemm")
    qtype = Q[args.format.upper()]
    shapes = MODEL_SHAPES[args.shapes]
    head = (VOCAB, shapes[1][1])
    quant_bf16 = registry.op("quant_panels_supported")(torch.bfloat16)
    raws = [[blocks(s, qtype, 100 * layer + i) for i, s in enumerate(shapes)] for layer in range(args.layers)]
    int8 = [[pack8(raw, int(qtype), s[1]) for raw, s in zip(layer, shapes)] for layer in raws]
    bf16 = [[registry.op("quant_panels_pack")(raw, int(qtype), s[1]) for raw, s in zip(layer, shapes)]
            for layer in raws] if quant_bf16 and qtype in (Q.Q4_1, Q.Q8_0) else None
    head_raw = blocks(head, Q.Q8_0, 7)
    head8 = pack8(head_raw, int(Q.Q8_0), head[1])
    head16 = registry.op("quant_panels_pack")(head_raw, int(Q.Q8_0), head[1]) if bf16 is not None else None
    layer_bytes = sum(raw.numel() for layer in raws for raw in layer)
    packed_bytes = sum(w.numel() for layer in int8 for w in layer)
    print(f"{args.layers} layers of {args.shapes} in {args.format}: {layer_bytes / 1e6:.1f} MB of blocks, "
          f"packed {packed_bytes / 1e6:.1f} MB ({packed_bytes / layer_bytes:.4f}x)", flush=True)
    layer_macs = args.layers * sum(o * i for o, i in shapes)
    results = []
    for m in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(m, s[1]) for s in shapes]
        xb = [x.bfloat16() for x in xs]
        xh = torch.randn(m, head[1])
        row = {"rows": m}
        t8 = best(lambda: [gemm8(x, w, None, s[0]) for layer in int8 for x, w, s in zip(xs, layer, shapes)], 7)
        h8 = best(lambda: gemm8(xh, head8, None, head[0]), 7)
        row.update(int8_layers_ms=round(t8 * 1e3, 3), int8_head_ms=round(h8 * 1e3, 3),
                   int8_layers_gb_s=round(layer_bytes / t8 / 1e9, 2),
                   int8_layers_gmac_s=round(m * layer_macs / t8 / 1e9, 1))
        line = (f"{m:5d} rows: int8 layers {t8 * 1e3:7.2f} ms ({layer_bytes / t8 / 1e9:5.1f} GB/s, "
                f"{m * layer_macs / t8 / 1e9:6.1f} GMAC/s), head {h8 * 1e3:6.2f} ms")
        if bf16 is not None:
            tb = best(lambda: [registry.op("bf16_gemm")(x, w, None, s[0])
                               for layer in bf16 for x, w, s in zip(xb, layer, shapes)], 7)
            hb = best(lambda: registry.op("bf16_gemm")(xh.bfloat16(), head16, None, head[0]), 7)
            row.update(bf16_layers_ms=round(tb * 1e3, 3), bf16_head_ms=round(hb * 1e3, 3),
                       layers_speedup=round(tb / t8, 3), head_speedup=round(hb / h8, 3))
            line += f" | bf16 panels on the blocks {tb * 1e3:7.2f} ms, head {hb * 1e3:6.2f} ms | {tb / t8:.2f}x, {hb / h8:.2f}x"
        print(line, flush=True)
        results.append(row)
    write_result("int8-gemm", {"args": vars(args), "threads": args.threads, "layer_block_bytes": layer_bytes,
                               "layer_packed_bytes": packed_bytes,
                               "layer_macs_per_row": layer_macs, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
