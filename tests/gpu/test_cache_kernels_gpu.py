"""The CUDA KV-cache writers against the torch reference, bit for bit, on the GPU.

Same cases as tests/csrc (tests/csrc/cases.py), so a layout that passes there through the host
run of the kernels' code must pass here through the real kernels. Also: the kernels' bytes
equal the CPU host run's (device and host share cache_kernels.cuh), dummy batches, the
null-block counter, CUDA-graph capture, side streams, torch.compile, and the engine's dispatch.
"""
from __future__ import annotations

import pytest
import torch

from engine.ops import registry

from engine.ops import kv_writer
from engine.paging import PAD_SLOT_ID
from tests.csrc.cases import (DTYPE_IDS, DTYPES, FP8, check_kv_write, check_mla_write, kv_case, mla_case,
                              raw)

pytestmark = pytest.mark.gpu

SCALE = 0.37
KV_LAYOUTS = [("contiguous", "contiguous"), ("qkv_slice", "kv_interleaved"), ("qkv_slice", "head_major"),
              ("misaligned", "contiguous")]
MLA_LAYOUTS = [("split", 0), ("contiguous", 8), ("misaligned", 0)]
CACHE_KINDS = [("same", None), ("fp8", None), ("fp8", SCALE)]
CACHE_IDS = ["same", "fp8", "fp8-scale"]


def cache_dtype_of(dtype, kind):
    return dtype if kind == "same" else FP8


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind, scale", CACHE_KINDS, ids=CACHE_IDS)
@pytest.mark.parametrize("layout, cache_layout", KV_LAYOUTS)
def test_reshape_and_cache_flash_bitwise(cuda_kernels, dtype, kind, scale, layout, cache_layout):
    case = kv_case(dtype, cache_dtype_of(dtype, kind), layout=layout, cache_layout=cache_layout, device="cuda")
    check_kv_write(cuda_kernels.reshape_and_cache_flash, *case, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind, scale", CACHE_KINDS, ids=CACHE_IDS)
@pytest.mark.parametrize("layout, cache_pad", MLA_LAYOUTS)
def test_concat_and_cache_mla_bitwise(cuda_kernels, dtype, kind, scale, layout, cache_pad):
    case = mla_case(dtype, cache_dtype_of(dtype, kind), layout=layout, cache_pad=cache_pad, device="cuda")
    check_mla_write(cuda_kernels.concat_and_cache_mla, *case, scale=scale)


@pytest.mark.parametrize("head_size, dtype", [(5, torch.float16), (6, torch.float16), (3, torch.float32),
                                              (12, torch.bfloat16), (128, torch.float32)])
def test_narrow_units_and_many_heads(cuda_kernels, head_size, dtype):
    heads = 40 if head_size == 128 else 3  # 40 x 128 x 4 B: more 16-byte units than threads
    check_kv_write(cuda_kernels.reshape_and_cache_flash,
                   *kv_case(dtype, dtype, head_size=head_size, num_heads=heads, device="cuda"))
    check_mla_write(cuda_kernels.concat_and_cache_mla,
                    *mla_case(dtype, dtype, kv_lora_rank=head_size + 2, rope_dim=head_size, device="cuda"))


@pytest.mark.parametrize("kind, scale", CACHE_KINDS, ids=CACHE_IDS)
def test_kernels_equal_the_host_run_of_their_code(cuda_kernels, kind, scale):
    """Three-way: GPU kernel == CPU op (the same .cuh on the host) == reference, already shown
    pairwise; here the GPU bytes are compared with the CPU op's directly."""
    for dtype in DTYPES:
        cuda_case = kv_case(dtype, cache_dtype_of(dtype, kind), layout="qkv_slice", device="cuda")
        cpu_case = kv_case(dtype, cache_dtype_of(dtype, kind), layout="qkv_slice", device="cpu")
        for case, device in ((cuda_case, "cuda"), (cpu_case, "cpu")):
            s = None if scale is None else torch.tensor([scale], device=device)
            registry.op("reshape_and_cache_flash")(*case, None, s)
        assert torch.equal(raw(cuda_case[2]).cpu(), raw(cpu_case[2]))
        assert torch.equal(raw(cuda_case[3]).cpu(), raw(cpu_case[3]))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_all_padded_dummy_batch_changes_no_byte(cuda_kernels, cache_dtype):
    key, value, k_cache, v_cache, slots = kv_case(torch.bfloat16, cache_dtype, device="cuda")
    kv_c, k_pe, mla_cache, mla_slots = mla_case(torch.bfloat16, cache_dtype, device="cuda")
    for t in (key, value, kv_c, k_pe):
        t.fill_(float("nan"))  # what a dummy batch's hidden states may hold
    before = [raw(t).clone() for t in (k_cache, v_cache, mla_cache)]
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    cuda_kernels.reshape_and_cache_flash(key, value, k_cache, v_cache, torch.full_like(slots, PAD_SLOT_ID), counter)
    cuda_kernels.concat_and_cache_mla(kv_c, k_pe, mla_cache, torch.full_like(mla_slots, PAD_SLOT_ID), counter)
    for t, b in zip((k_cache, v_cache, mla_cache), before):
        assert torch.equal(raw(t), b)
    assert counter.item() == 0


def test_null_block_counter_is_exact_and_needs_no_sync(cuda_kernels):
    key, value, k_cache, v_cache, _ = kv_case(torch.float16, torch.float16, num_tokens=8, block_size=4,
                                              device="cuda")
    counter = torch.tensor([100], dtype=torch.int64, device="cuda")
    slots = torch.tensor([3, 4, -1, 0, 1, 2, 17, -1], device="cuda")  # 0..3 are block 0
    for _ in range(3):
        cuda_kernels.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, counter)
    kv_c, k_pe, cache, _ = mla_case(torch.float16, torch.float16, num_tokens=8, block_size=4, device="cuda")
    cuda_kernels.concat_and_cache_mla(kv_c, k_pe, cache, slots, counter)
    assert counter.item() == 100 + 4 * 4


def test_many_tokens_all_slots_in_one_block_zero(cuda_kernels):
    """The historical bug's shape: a large dummy batch with zeroed slots hits block 0 thousands of times."""
    key, value, k_cache, v_cache, _ = kv_case(torch.bfloat16, torch.bfloat16, num_tokens=8192, num_heads=8,
                                              head_size=128, num_blocks=4, block_size=16, device="cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    cuda_kernels.reshape_and_cache_flash(key, value, k_cache, v_cache,
                                         torch.zeros(8192, dtype=torch.int64, device="cuda"), counter)
    assert counter.item() == 8192


def test_sixteen_k_tokens_random_slots(cuda_kernels):
    case = kv_case(torch.bfloat16, torch.bfloat16, num_tokens=16384, num_heads=8, head_size=128,
                   num_blocks=1100, block_size=16, device="cuda")
    check_kv_write(cuda_kernels.reshape_and_cache_flash, *case)
    case = mla_case(torch.bfloat16, torch.bfloat16, num_tokens=16384, kv_lora_rank=512, rope_dim=64,
                    num_blocks=1100, block_size=16, device="cuda")
    check_mla_write(cuda_kernels.concat_and_cache_mla, *case)


def test_out_of_range_slots_are_skipped(cuda_kernels):
    key, value, k_cache, v_cache, _ = kv_case(torch.float32, torch.float32, num_tokens=3, device="cuda")
    before = raw(k_cache).clone()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    cuda_kernels.reshape_and_cache_flash(key, value, k_cache, v_cache,
                                         torch.tensor([num_slots, 10**12, -7], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(raw(k_cache), before)


def test_cuda_graph_capture_and_replay(cuda_kernels):
    """The op enqueues on the current stream, so it can be captured (the engine pads steps to
    CUDA-graph sizes); replays see new slots and inputs written into the static buffers."""
    key, value, k_cache, v_cache, slots = kv_case(torch.float16, torch.float16, num_tokens=32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        cuda_kernels.reshape_and_cache_flash(key, value, k_cache.clone(), v_cache.clone(), slots, counter.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_kernels.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, counter)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        key.copy_(torch.randn(key.shape, generator=g).to(key))
        value.copy_(torch.randn(value.shape, generator=g).to(value))
        slots.copy_(torch.randperm(k_cache.shape[0] * k_cache.shape[1], generator=g)[:32])
        slots[::4] = PAD_SLOT_ID
        ref_k, ref_v, ref_counter = k_cache.clone(), v_cache.clone(), counter.clone()
        kv_writer.write_kv_reference(key, value, ref_k, ref_v, slots, ref_counter)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(raw(k_cache), raw(ref_k)) and torch.equal(raw(v_cache), raw(ref_v))
        assert counter.item() == ref_counter.item()


def test_side_stream_orders_with_its_own_work(cuda_kernels):
    key, value, k_cache, v_cache, slots = kv_case(torch.bfloat16, torch.bfloat16, device="cuda")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv_writer.write_kv_reference(key, value, ref_k, ref_v, slots)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cuda_kernels.reshape_and_cache_flash(key, value, k_cache, v_cache, slots)
        k_copy, v_copy = k_cache.clone(), v_cache.clone()  # same stream: sees the write
    stream.synchronize()
    assert torch.equal(raw(k_copy), raw(ref_k)) and torch.equal(raw(v_copy), raw(ref_v))


def test_torch_compile_inductor(cuda_kernels):
    def step(key, value, k_cache, v_cache, kv_c, k_pe, mla_cache, slots, counter):
        kv_writer.write_kv(key * 2, value, k_cache, v_cache, slots, counter)
        kv_writer.write_mla(kv_c, k_pe + 1, mla_cache, slots, counter)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for num_tokens in (13, 21):
        key, value, k_cache, v_cache, slots = kv_case(torch.float16, torch.float16, num_tokens=num_tokens,
                                                      device="cuda")
        kv_c, k_pe, mla_cache, _ = mla_case(torch.float16, torch.float16, num_tokens=num_tokens, num_blocks=9,
                                            device="cuda")
        eager = [t.clone() for t in (k_cache, v_cache, mla_cache)]
        eager_counter, counter = (torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(2))
        step(key, value, eager[0], eager[1], kv_c, k_pe, eager[2], slots, eager_counter)
        compiled(key, value, k_cache, v_cache, kv_c, k_pe, mla_cache, slots, counter)
        for got, want in zip((k_cache, v_cache, mla_cache), eager):
            assert torch.equal(raw(got), raw(want))
        assert counter.item() == eager_counter.item() > 0


def test_engine_dispatch_uses_the_kernels_on_cuda(cuda_kernels, monkeypatch):
    def no_reference(*args, **kwargs):
        raise AssertionError("CUDA caches must not go through the torch reference")
    monkeypatch.setattr(kv_writer, "write_kv_reference", no_reference)
    monkeypatch.setattr(kv_writer, "write_mla_reference", no_reference)
    key, value, k_cache, v_cache, slots = kv_case(torch.float32, torch.float32, device="cuda")
    kv_writer.write_kv(key, value, k_cache, v_cache, slots)
    kv_c, k_pe, cache, mla_slots = mla_case(torch.float32, torch.float32, device="cuda")
    kv_writer.write_mla(kv_c, k_pe, cache, mla_slots)


def test_wrapper_accepts_rows_that_are_not_contiguous(cuda_kernels):
    """A last dimension with stride != 1 is made contiguous by the wrapper, not rejected."""
    key, value, k_cache, v_cache, slots = kv_case(torch.float16, torch.float16, device="cuda")
    key_t = key.transpose(1, 2).contiguous().transpose(1, 2)  # same values, stride(-1) != 1
    assert key_t.stride(-1) != 1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv_writer.write_kv_reference(key, value, ref_k, ref_v, slots)
    cuda_kernels.reshape_and_cache_flash(key_t, value, k_cache, v_cache, slots)
    assert torch.equal(raw(k_cache), raw(ref_k))


def test_clear_errors(cuda_kernels):
    key, value, k_cache, v_cache, slots = kv_case(torch.float16, torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="all tensors must be on one device"):
        registry.op("reshape_and_cache_flash")(key, value, k_cache, v_cache, slots.cpu())
    with pytest.raises(RuntimeError, match="must equal key dtype"):
        cuda_kernels.reshape_and_cache_flash(key.float(), value.float(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="CUDA device"):
        cuda_kernels.reshape_and_cache_flash(key.cpu(), value.cpu(), k_cache.cpu(), v_cache.cpu(), slots.cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device(cuda_kernels):
    case = kv_case(torch.bfloat16, torch.bfloat16, device="cuda:1")
    check_kv_write(cuda_kernels.reshape_and_cache_flash, *case)
