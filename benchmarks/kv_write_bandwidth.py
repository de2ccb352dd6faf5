"""KV-cache write bandwidth: the csrc/ kernels beside a plain device-to-device copy of the same
bytes and beside the torch reference, from 1 to 16k tokens, in one run.

    python benchmarks/kv_write_bandwidth.py                 # table + ratios, exit 0
    python benchmarks/kv_write_bandwidth.py --check         # exit 1 if a kernel is under --target
    python benchmarks/kv_write_bandwidth.py --json out.json

GB/s counts bytes read + bytes written (payload only: K/V or latent rows, not the slot
mapping), for the kernel, the copy and the reference alike, so the ratio kernel/copy is the
share of copy bandwidth the kernel reaches. Slots are a shuffled set of whole blocks, like a
prefill of many requests. Target: >= 80% of the copy at >= 4096 tokens.

Without CUDA it says so and exits 0; --cpu-reference then times the torch reference on the CPU
(labelled as such: no kernel is measured). --smoke-cpu runs the GPU code path on the CPU through
the ops' CPU implementation, for tests; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.ops import cuda_ops, registry  # noqa: E402
from engine.ops.kv_writer import write_kv_reference, write_mla_reference  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Row:
    op: str
    tokens: int
    bytes_moved: int
    kernel_gbs: float | None
    copy_gbs: float | None
    reference_gbs: float

    @property
    def vs_copy(self) -> float | None:
        return None if self.kernel_gbs is None or not self.copy_gbs else self.kernel_gbs / self.copy_gbs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096, 8192, 16384])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--fp8", action="store_true", help="also time writes into a float8_e4m3fn cache (with a scale)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per measurement")
    p.add_argument("--repeats", type=int, default=5, help="measurements per point; the best is kept")
    p.add_argument("--target", type=float, default=0.80, help="kernel / copy bandwidth to reach ...")
    p.add_argument("--target-from", type=int, default=4096, help="... from this many tokens on")
    p.add_argument("--check", action="store_true", help="exit 1 when the target is missed")
    p.add_argument("--cpu-reference", action="store_true", help="without CUDA: time the CPU reference")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def time_cuda(fn, iters: int, repeats: int) -> float:
    """Best mean seconds per call over `repeats` runs of `iters` back-to-back calls (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    return best


def time_cpu(fn, iters: int, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters)
    return min(samples)


def block_slots(num_tokens: int, block_size: int, device) -> tuple[torch.Tensor, int]:
    """Slots of whole blocks in shuffled order, never block 0; returns (slots, num_blocks)."""
    blocks_needed = -(-num_tokens // block_size)
    num_blocks = blocks_needed + 1  # + the null block
    order = torch.randperm(blocks_needed, generator=torch.Generator().manual_seed(0)) + 1
    slots = (order[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:num_tokens]
    return slots.to(device), num_blocks


def kv_problem(args, num_tokens, device, cache_dtype):
    dtype = DTYPES[args.dtype]
    shape = (num_tokens, args.num_kv_heads, args.head_size)
    key, value = torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)
    slots, num_blocks = block_slots(num_tokens, args.block_size, device)
    cache_shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_size)
    k_cache = torch.zeros(cache_shape, device=device, dtype=cache_dtype)
    v_cache = torch.zeros(cache_shape, device=device, dtype=cache_dtype)
    moved = 2 * key.numel() * (key.element_size() + k_cache.element_size())  # k and v: read + write
    return (key, value, k_cache, v_cache, slots), moved, 2 * key.numel() * key.element_size()


def mla_problem(args, num_tokens, device, cache_dtype):
    dtype = DTYPES[args.dtype]
    kv_a = torch.randn(num_tokens, args.kv_lora_rank + args.rope_dim, device=device, dtype=dtype)
    kv_c, k_pe = kv_a.split([args.kv_lora_rank, args.rope_dim], dim=-1)  # the model's views
    slots, num_blocks = block_slots(num_tokens, args.block_size, device)
    cache = torch.zeros(num_blocks, args.block_size, args.kv_lora_rank + args.rope_dim, device=device,
                        dtype=cache_dtype)
    moved = kv_a.numel() * (kv_a.element_size() + cache.element_size())
    return (kv_c, k_pe, cache, slots), moved, kv_a.numel() * kv_a.element_size()


def run_kernels(args, device: torch.device, timer) -> list[Row]:
    """Kernel, d2d copy and torch reference for every op and token count, timed by `timer`."""
    dtype = DTYPES[args.dtype]
    variants = [("reshape_and_cache_flash", kv_problem, dtype), ("concat_and_cache_mla", mla_problem, dtype)]
    if args.fp8:
        variants += [("reshape_and_cache_flash fp8", kv_problem, torch.float8_e4m3fn),
                     ("concat_and_cache_mla fp8", mla_problem, torch.float8_e4m3fn)]
    rows = []
    for name, problem, cache_dtype in variants:
        is_kv = problem is kv_problem
        scale = torch.tensor([0.5], device=device) if cache_dtype == torch.float8_e4m3fn else None
        for num_tokens in args.tokens:
            tensors, moved, input_bytes = problem(args, num_tokens, device, cache_dtype)
            if is_kv:
                def kernel():
                    registry.op("reshape_and_cache_flash")(*tensors, None, scale)

                def reference():
                    write_kv_reference(*tensors, None, scale)
            else:
                def kernel():
                    registry.op("concat_and_cache_mla")(*tensors, None, scale)

                def reference():
                    write_mla_reference(*tensors, None, scale)
            # The copy moves the same input bytes: read once, written once (cudaMemcpyAsync D2D).
            src = torch.empty(input_bytes, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            t_kernel = timer(kernel, args.iters, args.repeats)
            t_copy = timer(lambda: dst.copy_(src), args.iters, args.repeats)
            t_ref = timer(reference, max(1, args.iters // 5), args.repeats)
            rows.append(Row(name, num_tokens, moved, moved / t_kernel / 1e9, 2 * input_bytes / t_copy / 1e9,
                            moved / t_ref / 1e9))
            del tensors, src, dst
    return rows


def run_cpu_reference(args) -> list[Row]:
    rows = []
    dtype = DTYPES[args.dtype]
    for name, problem, ref in (("reshape_and_cache_flash", kv_problem, write_kv_reference),
                               ("concat_and_cache_mla", mla_problem, write_mla_reference)):
        for num_tokens in args.tokens:
            tensors, moved, _ = problem(args, num_tokens, "cpu", dtype)
            t_ref = time_cpu(lambda: ref(*tensors), max(1, args.iters // 10), min(args.repeats, 3))
            rows.append(Row(name, num_tokens, moved, None, None, moved / t_ref / 1e9))
    return rows


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row], device: str) -> None:
    print(f"KV-cache write bandwidth on {device} (GB/s = (bytes read + bytes written) / time)")
    header = f"{'op':<34} {'tokens':>7} {'MB moved':>9} {'kernel':>8} {'d2d copy':>9} {'kern/copy':>9} " \
             f"{'torch ref':>9} {'kern/ref':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        speedup = None if r.kernel_gbs is None else r.kernel_gbs / r.reference_gbs
        print(f"{r.op:<34} {r.tokens:>7} {r.bytes_moved / 1e6:>9.2f} {fmt(r.kernel_gbs, '8.1f'):>8} "
              f"{fmt(r.copy_gbs, '9.1f'):>9} {fmt(r.vs_copy, '9.0%'):>9} {r.reference_gbs:>9.1f} "
              f"{fmt(speedup, '7.1f') + ('x' if speedup else ''):>8}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke_cpu:  # the GPU path on the CPU ops (tests/csrc): exercises the code, not the hardware
        from engine.ops import cpu_ops
        if not cpu_ops.available():
            print("the kvsentry CPU ops did not build (see the warning above).")
            return 1
        rows = run_kernels(args, torch.device("cpu"), time_cpu)
        device = "cpu (smoke run of the kernel path: timings are meaningless)"
        print_table(rows, device)
    elif not torch.cuda.is_available():
        print("CUDA is not available: no kernel bandwidth to measure on this machine.")
        if not args.cpu_reference:
            print("(--cpu-reference times the torch reference on the CPU instead.)")
            return 0
        rows = run_cpu_reference(args)
        device = "CPU: torch reference only, no kernel measured"
        print_table(rows, device)
    else:
        if not cuda_ops.available():
            print("CUDA is present but the kvsentry CUDA ops did not build (see the warning above).")
            return 1
        rows = run_kernels(args, torch.device("cuda"), time_cuda)
        device = torch.cuda.get_device_name()
        print_table(rows, device)
    verdict = 0
    measured = [r for r in rows if r.vs_copy is not None and r.tokens >= args.target_from]
    if measured:
        worst = min(measured, key=lambda r: r.vs_copy)
        ok = worst.vs_copy >= args.target
        print(f"\ntarget: kernel >= {args.target:.0%} of d2d copy bandwidth at >= {args.target_from} tokens: "
              f"{'PASS' if ok else 'FAIL'} (worst {worst.vs_copy:.0%}: {worst.op} at {worst.tokens} tokens)")
        verdict = 0 if ok or not args.check else 1
    if args.json:
        args.json.write_text(json.dumps({"device": device, "rows": [asdict(r) | {"vs_copy": r.vs_copy} for r in rows]},
                                        indent=2) + "\n")
    return verdict


if __name__ == "__main__":
    sys.exit(main())
