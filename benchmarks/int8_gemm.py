"""The GGUF linears of a decode step with int8 activations (csrc/cpu/cpu_int8_gemm.cpp) beside
the bf16 panels on the same Q4_1 blocks (csrc/cpu/cpu_quant_panels.h through bf16_gemm): each of
int8_gemm's kernels on its own -- AMX-INT8 tiles (cpu_int8_gemm_amx.cpp), AVX512-VNNI and the
256-bit AVX-VNNI (cpu_int8_gemm_avx.cpp), those this CPU has -- at every batch size, so that the
dispatch threshold can be read off.

    .venv/bin/python benchmarks/int8_gemm.py                        # both models, 1 and 2 threads
    .venv/bin/python benchmarks/int8_gemm.py --models smollm2 --threads 1 --rows 1,8,64
    .venv/bin/python benchmarks/int8_gemm.py --models 1b --format q4_k --threads 1 --rows 1,8
    .venv/bin/python benchmarks/int8_gemm.py --models smollm2 --format q4_0 --kernels avx512_vnni,avx_vnni

Models (the four GEMMs of a layer: q|k|v, o, gate|up, down; distinct random Q4_1 blocks per
layer, so that each call reads its blocks from memory as a decode step does):
  smollm2  SmolLM2-135M, the default model: hidden 576, intermediate 1536, 9 + 2 x 3 heads of
           64, 30 layers; and its Q8_0 LM head (49152 x 576) on its own line
  1b       a TinyLlama-like 1B-class model: hidden 2048, intermediate 5632, 32 + 2 x 4 heads of
           64; 4 of its 22 layers (100 MB of blocks, far past the caches)
At 1, 8, 32, 64 and 128 rows (--rows), the best of 5 passes of each side: ms per pass, GMAC/s,
and the int8 kernels' speed against the bf16 panels (and AVX-VNNI's against AVX512-VNNI's where
both run); at 64 rows also the AMX kernel's share of the AMX-INT8 tile peak (a register-resident
tdpbssd loop, as benchmarks/limits.py measures it). --kernels picks among amx_int8, avx512_vnni
and avx_vnni (default: all this CPU runs; the test build's switches run each alone).
--format gives the layers another GGML format (q4_0, q4_1, q5_0, q8_0, q4_k, q6_k; the K-quants
need K in whole super-blocks of 256: the 1b shapes); the bf16 side runs where its panels take the
format (q4_1, q8_0), the tiles where they do (q4_0, q4_1, q8_0). Outputs come from a heap that keeps freed memory and the blocks sit on huge pages, as in the
engine. Writes a JSON to benchmarks/results/. Needs AVX512-VNNI or AVX-VNNI, and AMX-INT8 for the
tile columns.
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
from engine.memory.host_memory import keep_freed_memory  # noqa: E402
from engine.memory.huge_pages import to_huge_pages  # noqa: E402
from engine.models.cpu_gemm import rows_layout  # noqa: E402
from engine.ops import registry  # noqa: E402

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14  # GGML type ids
FORMATS = {"q4_0": Q4_0, "q4_1": Q4_1, "q5_0": Q5_0, "q8_0": Q8_0, "q4_k": Q4_K, "q6_k": Q6_K}
# (values, bytes) per block, and where its float16 scales (and minima) sit in it.
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}
SCALE_AT = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q8_0: (0,), Q4_K: (0, 2), Q6_K: (208,)}
BF16_FORMATS, AMX_FORMATS = {Q4_1, Q8_0}, {Q4_0, Q4_1, Q8_0}
MODELS = {  # name: ((out, in) per layer, layers, GGML type)
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, Q4_1),
    "smollm2-head": ([(49152, 576)], 1, Q8_0),
    "1b": ([(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)], 4, Q4_1),
}
AMX_OFF = 1 << 40  # int8_gemm_amx_rows past every batch: the VNNI kernel alone
VECTOR_KERNELS = ("avx512_vnni", "avx_vnni")  # kvsentry_debug.int8_gemm_isa's choices


def random_blocks(shape: tuple[int, int], qtype: int, rng: np.random.Generator) -> torch.Tensor:
    """[out, in / values * block bytes] uint8: GGUF blocks of random bytes, with small positive
    float16 scales (and minima) at their places: the kernels' speed does not depend on the values."""
    out, k = shape
    values, size = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (out, k // values, size), dtype=np.uint8)
    for at in SCALE_AT[qtype]:
        blocks[..., at:at + 2] = (rng.random((out, k // values, 1), dtype=np.float32) * 0.01 + 1e-3
                                  ).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(out, -1))


def kernels_here(debug) -> list[str]:
    """The int8 kernels this CPU (and build) runs, each of which `run_alone` can pick."""
    vector = []
    for isa in VECTOR_KERNELS:
        try:
            debug.int8_gemm_isa(isa)
            vector.append(isa)
        except RuntimeError:  # this CPU (or build) lacks it
            pass
    debug.int8_gemm_isa("auto")
    return (["amx_int8"] if "amx_int8" in registry.op("int8_gemm_kernels")() else []) + vector


def run_alone(debug, kernel: str, threshold: int) -> None:
    """int8_gemm on `kernel` alone at every batch size; "auto" and `threshold`: the dispatch again."""
    debug.int8_gemm_isa("avx512_vnni" if kernel == "amx_int8" else kernel)
    debug.int8_gemm_amx_rows(1 if kernel == "amx_int8" else AMX_OFF if kernel == "avx512_vnni" else threshold)


def measure(model: str, rows: list[int], threads: list[int], debug, tile_peak: float | None,
            layer_format: int | None = None, kernels: tuple[str, ...] | list[str] = ()) -> list[dict]:
    shapes, layers, qtype = MODELS[model]
    if layer_format is not None and model != "smollm2-head":
        qtype = layer_format
    rng = np.random.default_rng(40)
    raws = [[random_blocks(s, qtype, rng) for s in shapes] for _ in range(layers)]
    # Both packings on huge pages, as the engine holds them (int8_linear.py, cpu_gemm.py).
    int8 = [[to_huge_pages(registry.op("int8_gemm_pack")(raw, qtype, s[1])) for raw, s in zip(layer, shapes)]
            for layer in raws]
    # The bf16 side in the layout the engine packs (cpu_gemm.rows_layout: Q4_1 on AMX CPUs with
    # AVX512-VBMI takes the rows layout, the same bits as the panels).
    bf16_pack = "quant_rows_pack" if rows_layout(torch.bfloat16, qtype) else "quant_panels_pack"
    bf16 = [[to_huge_pages(registry.op(bf16_pack)(raw, qtype, s[1])) for raw, s in zip(layer, shapes)]
            for layer in raws] if qtype in BF16_FORMATS and registry.available("bf16_gemm", "cpu") else None
    del raws
    gemm8, gemm16 = registry.op("int8_gemm"), registry.op("bf16_gemm")
    macs = layers * sum(o * i for o, i in shapes)
    amx = "amx_int8" in kernels and qtype in AMX_FORMATS
    threshold = debug.int8_gemm_amx_rows()
    results = []
    for count in threads:
        torch.set_num_threads(count)
        for m in rows:
            xs = [torch.randn(m, s[1]) for s in shapes]
            xb = [x.bfloat16() for x in xs]
            times = {}
            sides = (["amx_int8"] if amx else []) + [k for k in kernels if k in VECTOR_KERNELS]
            # Each output dropped as soon as it is made, as a forward pass frees it for the next
            # layer's (a list of all of a pass's outputs streamed them to fresh memory).
            def pass_of(fn, layers, inputs):
                return lambda: [fn(x, w, None, s[0]) is None for layer in layers for x, w, s in zip(inputs, layer, shapes)]
            for side in sides:
                run_alone(debug, side, threshold)
                times[side] = best(pass_of(gemm8, int8, xs))
            run_alone(debug, "auto", threshold)
            if bf16 is not None:
                times["bf16_panels"] = best(pass_of(gemm16, bf16, xb))
            row = {"model": model, "format": qtype, "threads": count, "rows": m}
            line = f"{model:>12} {count}t {m:4d} rows:"
            for side, t in times.items():
                row[f"{side}_ms"] = round(t * 1e3, 3)
                row[f"{side}_gmac_s"] = round(m * macs / t / 1e9, 1)
                line += f"  {side} {t * 1e3:7.2f} ms ({m * macs / t / 1e9:5.0f} GMAC/s)"
            for side in sides if bf16 is not None else ():
                row[f"{side}_vs_bf16"] = round(times["bf16_panels"] / times[side], 3)
                line += f"  {side}/bf16 {times['bf16_panels'] / times[side]:.2f}x"
            if set(VECTOR_KERNELS) <= times.keys():
                row["avx_vnni_vs_avx512_vnni"] = round(times["avx512_vnni"] / times["avx_vnni"], 3)
                line += f"  avx_vnni/avx512_vnni {row['avx_vnni_vs_avx512_vnni']:.2f}x"
            if amx and tile_peak and m == 64:
                row["amx_int8_share_of_tile_peak"] = round(m * macs / times["amx_int8"] / (count * tile_peak), 3)
                line += f"  ({row['amx_int8_share_of_tile_peak']:.0%} of the tile peak)"
            print(line, flush=True)
            results.append(row)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="smollm2,smollm2-head,1b")
    parser.add_argument("--rows", default="1,8,32,64,128")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--format", choices=sorted(FORMATS), help="the layers' GGML format (default: q4_1)")
    parser.add_argument("--kernels", help="int8 kernels to time, of amx_int8, avx512_vnni, avx_vnni "
                        "(default: all this CPU runs)")
    parser.add_argument("--json", help="write the JSON here instead of benchmarks/results/")
    args = parser.parse_args()
    keep_freed_memory()  # as the engine does: outputs reuse heap pages instead of faulting fresh ones in
    # The debug flavour of the library: its int8_gemm_amx_rows runs either int8 kernel at any size.
    debug = registry.debug_ops()
    if not registry.available("int8_gemm", "cpu"):
        print("int8_gemm does not run here (neither AVX512-VNNI nor AVX-VNNI)")
        return 1
    here = kernels_here(debug)
    kernels = here if args.kernels is None else args.kernels.split(",")
    if not set(kernels) <= set(here):
        print(f"not on this CPU (or build): {sorted(set(kernels) - set(here))}; it runs {here}")
        return 1
    tile_peak = debug.int8_amx_tile_peak(200000) if "amx_int8" in kernels else None
    if tile_peak:
        print(f"AMX-INT8 tile peak (one core, tdpbssd on resident 16 x 64 tiles): {tile_peak / 1e9:.0f} GMAC/s")
    rows = [int(r) for r in args.rows.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    results = [r for model in args.models.split(",") for r in measure(model, rows, threads, debug, tile_peak,
                                                                         FORMATS.get(args.format), kernels)]
    write_result("int8-gemm", {"args": vars(args), "kernels": kernels,
                               "amx_min_rows": debug.int8_gemm_amx_rows(),
                               "amx_int8_tile_peak_gmac_s": None if tile_peak is None else round(tile_peak / 1e9, 1),
                               "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
