"""How far the engine's decode step is from this machine's limits, on the real default model.

    .venv/bin/python benchmarks/limits.py --dtype bfloat16

Measures, on one thread:
  - memory bandwidth: a float32 sum over 1 GiB on huge pages (read only, one pass, best of 5), the
    bound of a weight-streaming step;
  - GEMM peak: the model's four layer GEMMs (q|k|v, o, gate|up, down) packed as the engine runs
    them (cpu_gemm.PackedLinear), at 256 and 1024 rows, in GFLOP/s;
  - int8 multiply-add rate: the int8-activation GEMM (AMX-INT8 tiles where the CPU has them, else
    vpdpbusd) on the same shapes as Q8_0 blocks at 256 rows, in GMAC/s (where AVX512-VNNI is
    there), and the int8 peaks: vpdpbusd back to back on resident registers (where AVX512-VNNI
    is) and tdpbssd back to back on resident tiles (where AMX-INT8 is);
  - the engine: decode steps at batch 1 and at batch 64 (128-token prompts, greedy), as bytes of
    weights read per second at batch 1 -- the bytes its linears hold as the step reads them: the
    GGUF's own Q4_1 / Q8_0 blocks where the panels are those (csrc/cpu/cpu_quant_panels.h), else the
    dtype's -- and as forward GFLOP/s at batch 64.
and prints each achieved figure beside its limit; the figures go into a JSON in benchmarks/results/
(named by date, machine kind and commit).
"""
from __future__ import annotations

import argparse
import time

import torch

from common import bench_checkpoint, best, prompt_token_range, random_prompts
from results import write_result


def memory_bandwidth() -> float:  # bytes/s
    # 1 GiB: far past the last-level cache; on huge pages, as the engine's weights and KV cache
    # are (engine/memory/huge_pages.py), so that the limit is the one the engine can reach.
    from engine.memory.huge_pages import huge_page_zeros
    x = huge_page_zeros((256 * 1024 * 1024,), torch.float32).fill_(1.0)
    return x.numel() * 4 / best(lambda: x.sum())


def gemm_peak(model, rows: int, dtype: torch.dtype) -> float:  # FLOP/s over the model's layer shapes
    from engine.models.cpu_gemm import PackedLinear
    layer = model.model.layers[0]
    weights = [layer.self_attn.qkv, layer.self_attn.o_proj.packed, layer.mlp.gate_up, layer.mlp.down_proj.packed]
    shapes = [(w.out_features, w.in_features) for w in weights]
    linears = [PackedLinear(torch.randn(*s).to(dtype) * 0.05) for s in shapes]
    inputs = [torch.randn(rows, s[1]).to(dtype) for s in shapes]
    flop = sum(2 * rows * o * i for o, i in shapes)
    return flop / best(lambda: [lin(x) for lin, x in zip(linears, inputs)])


def int8_peak(model, rows: int) -> float | None:  # int8 multiply-adds/s over the model's layer shapes
    """The int8-activation GEMM (csrc/cpu/cpu_int8_gemm.cpp, vpdpbusd) on the model's four layer
    shapes as Q8_0 blocks at `rows` rows: the multiply-add rate the int8 path reaches when the
    weights sit in cache and the batch is large; None where the kernel does not run."""
    import gguf
    import numpy as np
    from engine.ops import registry
    if not registry.available("int8_gemm", "cpu"):
        return None
    layer = model.model.layers[0]
    linears = [layer.self_attn.qkv, layer.self_attn.o_proj.packed, layer.mlp.gate_up, layer.mlp.down_proj.packed]
    shapes = [(w.out_features, w.in_features) for w in linears]
    q8 = gguf.GGMLQuantizationType.Q8_0
    packed = [registry.op("int8_gemm_pack")(torch.from_numpy(np.ascontiguousarray(gguf.quantize(
        np.random.default_rng(i).standard_normal(s).astype(np.float32), q8))), int(q8), s[1])
        for i, s in enumerate(shapes)]
    inputs = [torch.randn(rows, s[1]) for s in shapes]
    gemm = registry.op("int8_gemm")
    macs = sum(rows * o * i for o, i in shapes)
    return macs / best(lambda: [gemm(x, w, None, s[0]) for x, w, s in zip(inputs, packed, shapes)])


def amx_int8_tile_peak() -> float | None:  # int8 multiply-adds/s of one core's AMX tiles
    """tdpbssd on resident 16 x 64-byte tiles, back to back (csrc/cpu/cpu_int8_gemm_amx.cpp, the
    test build's int8_amx_tile_peak): the arithmetic ceiling of the int8 path on an AMX core;
    None where there is no AMX-INT8."""
    from engine.ops import registry
    if not registry.available("int8_gemm", "cpu") or "amx_int8" not in registry.op("int8_gemm_kernels")():
        return None
    return max(registry.debug_ops().int8_amx_tile_peak(200000) for _ in range(3))


def vnni_peak() -> float | None:  # int8 multiply-adds/s of one core's 512-bit VNNI
    """vpdpbusd back to back on 16 register-resident accumulators (csrc/cpu/cpu_int8_gemm.cpp, the
    test build's int8_vnni_peak): the arithmetic ceiling of the 512-bit int8 kernel; None where
    the CPU or build has no AVX512-VNNI."""
    from engine.ops import registry
    if not registry.available("int8_gemm", "cpu") or "avx512_vnni" not in registry.op("int8_gemm_kernels")():
        return None
    return max(registry.debug_ops().int8_vnni_peak(2_000_000) for _ in range(3))


def decode_seconds(llm, batch: int, vocab: int, low: int, seed: int) -> float:
    from engine import SamplingParams
    from engine.messages import EngineRequest
    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, 128, vocab=vocab, seed=seed, low=low)):
        core.add_request(EngineRequest(f"limits-{seed}-{i}", prompt, params))
    for _ in range(4):  # the prefill and the first decodes
        core.step()
    steps = []
    for _ in range(20):
        start = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - start)
    while core.has_unfinished:
        core.step()
    return sorted(steps)[len(steps) // 4]  # a low quartile: the machine is shared


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", help="write the JSON here instead of benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from engine.ops import registry
    registry.debug_ops()  # the test build (the engine's ops and the int8 peaks), before the engine loads one
    from engine import LLM
    path = bench_checkpoint(args.model)
    low, vocab = prompt_token_range(path)
    llm = LLM(path, max_model_len=1024, dtype=args.dtype, enable_prefix_caching=False, num_threads=1)
    model = llm.engine.runner.model
    dtype = getattr(torch, args.dtype)
    # The matrices a decode step reads: every layer's four GEMMs and the LM head (the embedding
    # is a lookup of a few rows; norms are vectors). 2 FLOP per weight per token.
    linears = [w for layer in model.model.layers
               for w in (layer.self_attn.qkv, layer.self_attn.o_proj.packed, layer.mlp.gate_up,
                         layer.mlp.down_proj.packed)]
    head = model.lm_head.packed
    params = sum(w.out_features * w.in_features for w in linears) + (
        head.out_features * head.in_features if head is not None else model.lm_head.weight.numel())
    dense_bytes = params * dtype.itemsize

    def read_bytes(linear) -> int:  # what a one-row step streams of this linear
        if getattr(linear, "int8", None) is not None:  # GGUF blocks with int8 activations
            return linear.int8.nbytes
        if linear.uses_panels(1):
            return linear.panels.numel() * linear.panels.element_size()
        return linear.out_features * linear.in_features * dtype.itemsize

    weight_bytes = sum(read_bytes(w) for w in linears) + (
        read_bytes(head) if head is not None else model.lm_head.weight.numel() * dtype.itemsize)
    flop_per_token = 2 * params

    bandwidth = memory_bandwidth()
    peaks = {rows: gemm_peak(model, rows, dtype) for rows in (256, 1024)}
    int8_macs = int8_peak(model, 256)
    tile_peak = amx_int8_tile_peak()
    register_peak = vnni_peak()
    step1 = decode_seconds(llm, 1, vocab, low, seed=1)
    step64 = decode_seconds(llm, 64, vocab, low, seed=2)
    batch64_macs = 64 * flop_per_token / 2 / step64  # multiply-adds/s of the batch-64 decode step

    print(f"model: {params / 1e6:.1f} M weights in its GEMMs, {dense_bytes / 1e6:.0f} MB of {args.dtype}, "
          f"{weight_bytes / 1e6:.0f} MB as a one-row step reads them, {flop_per_token / 1e9:.3f} GFLOP per token")
    print(f"memory bandwidth (1 GiB float32 sum on huge pages, 1 thread): {bandwidth / 1e9:.1f} GB/s")
    for rows, peak in peaks.items():
        print(f"GEMM peak, the model's layer shapes at {rows} rows: {peak / 1e9:.0f} GFLOP/s")
    print(f"batch 1 decode: {step1 * 1e3:.1f} ms/step -> {weight_bytes / step1 / 1e9:.1f} GB/s of weights "
          f"= {weight_bytes / step1 / bandwidth:.0%} of the measured bandwidth "
          f"(floor {weight_bytes / bandwidth * 1e3:.1f} ms/step, {bandwidth / weight_bytes:.0f} tok/s)")
    if int8_macs is not None:
        print(f"int8 multiply-add rate (int8 GEMM, the model's layer shapes as Q8_0, 256 rows): "
              f"{int8_macs / 1e9:.0f} GMAC/s = {2 * int8_macs / 1e9:.0f} GOP/s")
    if register_peak is not None:
        print(f"AVX512-VNNI peak (vpdpbusd on resident registers, 1 thread): {register_peak / 1e9:.0f} GMAC/s; "
              + ("" if int8_macs is None else f"the int8 GEMM at 256 rows reaches {int8_macs / register_peak:.0%}, ")
              + f"batch 64 decode {batch64_macs / register_peak:.1%}")
    if tile_peak is not None:
        print(f"AMX-INT8 tile peak (tdpbssd on resident tiles, 1 thread): {tile_peak / 1e9:.0f} GMAC/s; "
              f"batch 64 decode reaches {batch64_macs / tile_peak:.1%} of it")
    best_peak = max(peaks.values())
    print(f"batch 64 decode: {step64 * 1e3:.1f} ms/step -> {64 * flop_per_token / step64 / 1e9:.0f} GFLOP/s "
          f"= {64 * flop_per_token / step64 / best_peak:.0%} of the GEMM peak ({64 / step64:.0f} tok/s)")
    write_result(f"limits-{args.dtype}", {
        "args": vars(args), "model": path, "threads": 1,
        "model_figures": {"gemm_weights": params, "dense_bytes": dense_bytes, "one_row_step_bytes": weight_bytes,
                          "flop_per_token": flop_per_token},
        "memory_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "gemm_peak_gflop_s": {str(rows): round(peak / 1e9, 1) for rows, peak in peaks.items()},
        "batch1_step_ms": round(step1 * 1e3, 2), "batch1_weights_gb_s": round(weight_bytes / step1 / 1e9, 2),
        "batch64_step_ms": round(step64 * 1e3, 2),
        "batch64_gflop_s": round(64 * flop_per_token / step64 / 1e9, 1),
        "batch64_share_of_gemm_peak": round(64 * flop_per_token / step64 / best_peak, 3),
        "int8_gemm_gmac_s_256_rows": None if int8_macs is None else round(int8_macs / 1e9, 1),
        "batch64_share_of_int8_rate": None if int8_macs is None else round(
            batch64_macs / int8_macs, 3),
        "vnni_int8_peak_gmac_s": None if register_peak is None else round(register_peak / 1e9, 1),
        "int8_gemm_share_of_vnni_peak": None if register_peak is None or int8_macs is None else round(
            int8_macs / register_peak, 3),
        "batch64_share_of_vnni_peak": None if register_peak is None else round(
            batch64_macs / register_peak, 4),
        "amx_int8_tile_peak_gmac_s": None if tile_peak is None else round(tile_peak / 1e9, 1),
        "batch64_share_of_amx_int8_tile_peak": None if tile_peak is None else round(
            batch64_macs / tile_peak, 4)}, args.json)


if __name__ == "__main__":
    main()
