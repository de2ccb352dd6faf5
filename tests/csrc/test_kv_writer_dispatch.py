"""engine.ops.kv_writer: the torch reference's contract and the one dispatch function (no build needed)."""
from __future__ import annotations

import pytest
import torch

from engine.ops import cuda_ops, registry
from engine.ops import kv_writer
from engine.paging import PAD_SLOT_ID
from engine.ops.kv_writer import write_kv, write_kv_reference, write_mla, write_mla_reference

FP8 = torch.float8_e4m3fn


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def kv_inputs(num_tokens=6, heads=2, head_size=8, num_blocks=4, block_size=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    key = torch.randn(num_tokens, heads, head_size, generator=g).to(dtype)
    value = torch.randn(num_tokens, heads, head_size, generator=g).to(dtype)
    k_cache = torch.zeros(num_blocks, block_size, heads, head_size, dtype=dtype)
    return key, value, k_cache, k_cache.clone()


# --- the reference ---------------------------------------------------------------------------

def test_reference_writes_real_slots_and_skips_pad_slots():
    key, value, k_cache, v_cache = kv_inputs()
    slots = torch.tensor([5, PAD_SLOT_ID, 9, 2, PAD_SLOT_ID, 15])
    counter = torch.zeros(1, dtype=torch.int64)
    write_kv_reference(key, value, k_cache, v_cache, slots, counter)
    flat_k, flat_v = k_cache.view(16, 2, 8), v_cache.view(16, 2, 8)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[token]) and torch.equal(flat_v[slot], value[token])
    untouched = [s for s in range(16) if s not in (5, 9, 2, 15)]
    assert flat_k[untouched].eq(0).all() and flat_v[untouched].eq(0).all()
    assert counter.item() == 1  # slot 2 is in block 0 (block_size 4); -1 is not counted


def test_reference_counter_accumulates():
    key, value, k_cache, v_cache = kv_inputs()
    counter = torch.tensor([7], dtype=torch.int64)
    write_kv_reference(key, value, k_cache, v_cache, torch.tensor([0, 1, 3, 4, -1, -1]), counter)
    assert counter.item() == 7 + 3


def test_reference_dummy_batch_leaves_cache_unchanged():
    key, value, k_cache, v_cache = kv_inputs()
    k_cache.normal_()
    v_cache.normal_()
    before = (k_cache.clone(), v_cache.clone())
    counter = torch.zeros(1, dtype=torch.int64)
    write_kv_reference(key.fill_(float("nan")), value.fill_(float("nan")), k_cache, v_cache,
                       torch.full((6,), PAD_SLOT_ID), counter)
    assert torch.equal(raw(k_cache), raw(before[0])) and torch.equal(raw(v_cache), raw(before[1]))
    assert counter.item() == 0


def test_reference_mla_layout_is_compressed_then_rope():
    kv_c = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)
    k_pe = -torch.arange(3 * 2, dtype=torch.float32).view(3, 2) - 1
    cache = torch.zeros(2, 4, 6)
    counter = torch.zeros(1, dtype=torch.int64)
    write_mla_reference(kv_c, k_pe, cache, torch.tensor([6, PAD_SLOT_ID, 1]), counter)
    flat = cache.view(8, 6)
    assert torch.equal(flat[6], torch.cat([kv_c[0], k_pe[0]]))
    assert torch.equal(flat[1], torch.cat([kv_c[2], k_pe[2]]))
    assert flat[[0, 2, 3, 4, 5, 7]].eq(0).all()
    assert counter.item() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_fp8_cache_with_and_without_scale(dtype):
    key, value, _, _ = kv_inputs(dtype=dtype)
    key[0, 0, :4] = torch.tensor([1e4, float("inf"), float("-inf"), float("nan")]).to(dtype)
    slots = torch.tensor([0, 3, PAD_SLOT_ID, 8, 12, 13])
    valid = slots >= 0
    for scale in (None, torch.tensor([0.37]), 2.5):
        k_cache = torch.zeros(4, 4, 2, 8, dtype=FP8)
        v_cache = torch.zeros_like(k_cache)
        write_kv_reference(key, value, k_cache, v_cache, slots, None, scale)
        x = key[valid].float() / (1.0 if scale is None else torch.tensor([float(scale)]))
        stored = k_cache.view(16, 2, 8)[slots[valid]]
        assert torch.equal(raw(stored), raw(x.clamp(-448, 448).to(FP8)))
        # Overflow and +-inf saturate to +-448 (whatever torch's .to() does: 2.11 made NaN of
        # them); a NaN stays NaN, so the sentinel still sees what the model produced.
        assert raw(stored)[:3].tolist() == [0x7E, 0x7E, 0xFE] and raw(stored)[3] & 0x7F == 0x7F


def test_reference_rejects_scale_for_non_fp8_cache():
    key, value, k_cache, v_cache = kv_inputs()
    with pytest.raises(ValueError, match="float8_e4m3fn cache only"):
        write_kv_reference(key, value, k_cache, v_cache, torch.arange(6), None, torch.tensor([2.0]))


def test_reference_only_reads_the_first_num_tokens_rows():
    key, value, k_cache, v_cache = kv_inputs()
    write_kv_reference(key, value, k_cache, v_cache, torch.tensor([1, 2]))
    assert torch.equal(k_cache.view(16, 2, 8)[1:3], key[:2])
    assert k_cache.view(16, 2, 8)[3:].eq(0).all()


# --- the dispatch ----------------------------------------------------------------------------

class PretendCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, to drive write_kv's CUDA branch on a CPU machine."""

    @property
    def is_cuda(self):  # noqa: D401
        return True


def test_cpu_caches_never_touch_cuda_ops(monkeypatch):
    monkeypatch.setattr(cuda_ops, "available", lambda: pytest.fail("CPU caches must not ask for the kernels"))
    key, value, k_cache, v_cache = kv_inputs()
    write_kv(key, value, k_cache, v_cache, torch.arange(6))
    write_mla(torch.randn(2, 4), torch.randn(2, 2), torch.zeros(2, 4, 6), torch.tensor([1, -1]))
    assert torch.equal(k_cache.view(16, 2, 8)[:6], key)


@pytest.mark.parametrize("kernels", [True, False])
def test_cuda_caches_dispatch_to_the_kernels_when_available(monkeypatch, kernels):
    calls = []
    monkeypatch.setattr(cuda_ops, "available", lambda: kernels)
    monkeypatch.setattr(cuda_ops, "reshape_and_cache_flash", lambda *a: calls.append(("kv", a)))
    monkeypatch.setattr(cuda_ops, "concat_and_cache_mla", lambda *a: calls.append(("mla", a)))
    key, value, k_cache, v_cache = kv_inputs()
    k_cuda = k_cache.as_subclass(PretendCuda)
    counter, scale = torch.zeros(1, dtype=torch.int64), None
    write_kv(key, value, k_cuda, v_cache, torch.arange(6), counter, scale)
    cache = torch.zeros(2, 4, 6).as_subclass(PretendCuda)
    write_mla(torch.randn(2, 4), torch.randn(2, 2), cache, torch.tensor([1, -1]), counter)
    if kernels:
        assert [c[0] for c in calls] == ["kv", "mla"]
        assert calls[0][1][2] is k_cuda and calls[0][1][5] is counter and len(calls[0][1]) == 7
        assert k_cache.eq(0).all()  # the reference did not run
    else:
        assert calls == []
        assert torch.equal(k_cache.view(16, 2, 8)[:6], key)


def test_available_is_false_without_cuda_and_builds_nothing(monkeypatch):
    monkeypatch.setattr(registry, "build", lambda *a, **k: pytest.fail("must not build"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_ops.available() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("KVSENTRY_DISABLE_CUDA_OPS", "1")
    assert cuda_ops.available() is False


def test_failed_build_falls_back_with_a_warning_or_raises_when_required(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("nvcc exploded")
    monkeypatch.setattr(registry, "build", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    registry._cuda_library_ok.cache_clear()
    try:
        assert cuda_ops.available() is False
        assert "nvcc exploded" in caplog.text
        registry._cuda_library_ok.cache_clear()
        monkeypatch.setenv("KVSENTRY_REQUIRE_CUDA_OPS", "1")
        with pytest.raises(RuntimeError, match="nvcc exploded"):
            cuda_ops.available()
    finally:
        registry._cuda_library_ok.cache_clear()


def test_cuda_ops_wrappers_refuse_cpu_tensors():
    key, value, k_cache, v_cache = kv_inputs()
    with pytest.raises(ValueError, match="CUDA device"):
        cuda_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, torch.arange(6))
    with pytest.raises(ValueError, match="CUDA device"):
        cuda_ops.concat_and_cache_mla(torch.randn(2, 4), torch.randn(2, 2), torch.zeros(2, 4, 6), torch.arange(2))


def test_kv_writer_signatures_stay_backward_compatible():
    key, value, k_cache, v_cache = kv_inputs()
    counter = torch.zeros(1, dtype=torch.int64)
    kv_writer.write_kv(key, value, k_cache, v_cache, torch.arange(6), counter)  # the engine's call
    kv_writer.write_kv_reference(key, value, k_cache, v_cache, torch.arange(6), counter)
    assert counter.item() == 8


def test_available_is_a_constant_under_torch_compile():
    """Dynamo cannot trace the cached build behind available(); it must be evaluated eagerly and
    baked in (torch.compiler.assume_constant_result), or write_kv breaks fullgraph compiles on GPU."""
    assert getattr(cuda_ops.available, "_dynamo_marked_constant", False)

    def step(x):
        return x + 1 if cuda_ops.available() else x - 1

    torch._dynamo.reset()
    assert torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2)).tolist() == [0.0, 0.0]
