"""engine/memory/huge_pages.py: packed weights and the CPU KV cache on mappings advised for
transparent huge pages, carved without overlap, zeroed, and given back when freed."""
from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from engine.memory import huge_pages
from engine.memory.huge_pages import CHUNK, HUGE_PAGE, huge_page_zeros, to_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode of THP (always, madvise, never), None off Linux."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry holding `address`: its range line and fields."""
    entry: dict[str, str] | None = None
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            if found is not None:
                return found
            lo, hi = (int(x, 16) for x in head.split("-"))
            entry = {"range": line}
            found = entry if lo <= address < hi else None
        elif entry is not None and ":" in head:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return found


def test_zeros_of_the_shape_contiguous_and_separate():
    a = huge_page_zeros((3, 5, 7), torch.bfloat16)
    b = huge_page_zeros((1000,), torch.float32)
    assert a.shape == (3, 5, 7) and a.dtype == torch.bfloat16 and a.is_contiguous()
    assert torch.count_nonzero(a) == 0 and torch.count_nonzero(b) == 0
    assert a.data_ptr() % huge_pages.ALIGN == 0 and b.data_ptr() % huge_pages.ALIGN == 0
    a.fill_(1.5)
    b.fill_(-2.0)
    assert bool((a == 1.5).all()) and bool((b == -2.0).all())  # neither write reached the other
    a_end, b_end = a.data_ptr() + a.numel() * 2, b.data_ptr() + b.numel() * 4
    assert a_end <= b.data_ptr() or b_end <= a.data_ptr()


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages on this OS")
def test_memory_is_advised_for_huge_pages():
    """THPeligible is the kernel's own answer to "may this mapping get huge pages": 1 for
    ours, where an unadvised anonymous mapping of the same size says 0 (THP `madvise` mode) -- so the
    test fails if the madvise is lost."""
    t = huge_page_zeros((4 * HUGE_PAGE,), torch.uint8)
    assert _mapping_of(t.data_ptr())["THPeligible"] == "1"
    if _thp_mode() == "madvise":
        # The control is a fresh anonymous mapping nobody advised. (A plain torch tensor is no
        # control: malloc may carve it from a heap or arena that something else advised.)
        plain = mmap.mmap(-1, 4 * HUGE_PAGE)
        view = (ctypes.c_char * len(plain)).from_buffer(plain)
        try:
            plain_entry = _mapping_of(ctypes.addressof(view))
            assert plain_entry is not None and plain_entry["THPeligible"] == "0"
        finally:
            del view
            plain.close()


def test_a_large_tensor_gets_its_own_mapping_and_gives_it_back():
    big = huge_page_zeros((CHUNK // 4 + 1,), torch.float32)
    address = big.data_ptr()
    assert _mapping_of(address) is not None
    big[-1] = 3.0
    assert float(big[-1]) == 3.0
    del big
    assert _mapping_of(address) is None  # unmapped with its last tensor


def test_to_huge_pages_copies_and_disables(monkeypatch):
    src = torch.randn(300, 70)
    copy = to_huge_pages(src)
    assert torch.equal(copy, src) and copy.data_ptr() != src.data_ptr()
    monkeypatch.setenv("KVSENTRY_DISABLE_HUGE_PAGES", "1")
    assert to_huge_pages(src) is src
    plain = huge_page_zeros((10,), torch.float32)
    assert torch.count_nonzero(plain) == 0


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages on this OS")
def test_packed_weights_and_kv_cache_live_on_advised_memory():
    from engine.config import EngineConfig, ModelConfig
    from engine.models.cpu_gemm import PackedLinear
    from engine.worker.kv_cache import allocate_kv_storage

    model = ModelConfig(path="", architecture="LlamaForCausalLM", hf_config={}, vocab_size=64, hidden_size=64,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
                        tie_word_embeddings=False, dtype=torch.bfloat16)
    config = EngineConfig(model=model, block_size=16, num_blocks=64, max_model_len=128)
    storage = allocate_kv_storage(config)
    assert storage.shape == (2, 2, 2, 64, 16, 16)
    assert torch.count_nonzero(storage) == 0
    assert _mapping_of(storage.data_ptr())["THPeligible"] == "1"
    linear = PackedLinear(torch.randn(192, 128))
    if linear.panels is None:
        pytest.skip("this CPU (or build) runs no panel GEMM: nothing packed to place")
    assert _mapping_of(linear.panels.data_ptr())["THPeligible"] == "1"
