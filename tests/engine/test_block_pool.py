"""Block pool and KV cache manager: null block, ref counts, prefix cache, LRU eviction."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.block_pool import BlockPool, hash_block
from engine.paging import NULL_BLOCK_ID
from engine.core.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4  # block size used throughout


def make_request(tokens: list[int], key: str = "r", **params) -> Request:
    return Request(key, 0, list(tokens), SamplingParams(**params), eos_token_id=None, arrival_time=0.0)


def compute(kv: KVCacheManager, request: Request, num_new: int | None = None, use_cache: bool = True) -> list[int]:
    """What the scheduler + engine do for a fresh request: prefix lookup, allocate, compute, cache."""
    hits = kv.get_computed_blocks(request) if use_cache else []
    if num_new is None:
        num_new = request.num_tokens - len(hits) * BS
    assert kv.allocate_slots(request, num_new, hits)
    if use_cache:
        kv.record_prefix_lookup(request.num_tokens, len(hits) * BS)
    request.num_computed_tokens += num_new
    kv.cache_computed_blocks(request)
    return hits


def pool_state(pool: BlockPool):
    return (list(pool.ref_counts), list(pool.free_queue), dict(pool.cached), list(pool.block_hash))


# ------------------------------------------------------------------------------ null block

def test_null_block_never_allocated_when_drained():
    pool = BlockPool(8)
    assert pool.num_free_blocks == 7
    blocks = pool.allocate(7)
    assert sorted(blocks) == list(range(1, 8))
    assert NULL_BLOCK_ID not in blocks
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(blocks)
    again = pool.allocate(7)
    assert NULL_BLOCK_ID not in again and sorted(again) == list(range(1, 8))


def test_null_block_never_allocated_through_manager():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    owned = []
    i = 0
    while True:
        request = make_request(list(range(100 + 10 * i, 100 + 10 * i + BS)), key=f"r{i}")
        if not kv.allocate_slots(request, BS):
            break
        owned.extend(request.block_ids)
        i += 1
    assert i == 5
    assert NULL_BLOCK_ID not in owned
    assert kv.pool.num_free_blocks == 0
    assert kv.pool.ref_counts[NULL_BLOCK_ID] == 0


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit", "drop"]),
                          st.integers(0, 5), st.integers(0, 3)), max_size=60))
def test_random_pool_ops_keep_invariants(ops):
    """Any mix of allocate/free/cache/touch/drop keeps the pool's books consistent."""
    pool = BlockPool(7)
    owners: list[list[int]] = []
    next_hash = 0
    for op, a, b in ops:
        if op == "alloc":
            count = min(a, 3)
            if count <= pool.num_free_blocks:
                owners.append(pool.allocate(count))
            else:
                with pytest.raises(RuntimeError):
                    pool.allocate(count)
        elif op == "free" and owners:
            pool.free(owners.pop(a % len(owners)))
        elif op == "cache" and owners and owners[a % len(owners)]:
            blocks = owners[a % len(owners)]
            pool.cache(blocks[b % len(blocks)], next_hash.to_bytes(4, "little"))
            next_hash += 1
        elif op == "hit" and pool.cached:
            block_hash = sorted(pool.cached)[a % len(pool.cached)]
            block = pool.lookup(block_hash)
            pool.touch([block])
            owners.append([block])
        elif op == "drop" and owners and owners[a % len(owners)]:
            blocks = owners[a % len(owners)]
            block = blocks[b % len(blocks)]
            pool.drop_from_cache(block)
            assert pool.block_hash[block] is None
            assert block not in pool.cached.values()
        # Invariants after every operation.
        refs = [0] * pool.num_blocks
        for blocks in owners:
            for block in blocks:
                refs[block] += 1
        assert refs == pool.ref_counts
        assert NULL_BLOCK_ID not in pool.free_queue
        assert pool.ref_counts[NULL_BLOCK_ID] == 0
        assert set(pool.free_queue) == {b for b in range(1, 7) if refs[b] == 0}
        for block_hash, block in pool.cached.items():
            assert pool.block_hash[block] == block_hash
            assert block != NULL_BLOCK_ID
    for blocks in owners:
        pool.free(blocks)
    assert pool.num_free_blocks == pool.num_blocks - 1


# ------------------------------------------------------------------------------ ref counts

def test_shared_prefix_blocks_freed_only_by_last_user():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(10, 10 + 2 * BS)) + [99]
    a = make_request(prompt, "a")
    compute(kv, a)
    assert len(a.block_ids) == 3
    b = make_request(prompt[:-1] + [77], "b")
    hits = compute(kv, b)
    assert hits == a.block_ids[:2]
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    shared = a.block_ids[:2]
    assert all(kv.pool.ref_counts[x] == 2 for x in shared)
    free_before = kv.pool.num_free_blocks
    a_tail = a.block_ids[2]
    kv.free(a)
    assert a.block_ids == []
    assert all(kv.pool.ref_counts[x] == 1 for x in shared)
    assert all(x not in kv.pool.free_queue for x in shared)
    assert a_tail in kv.pool.free_queue
    assert kv.pool.num_free_blocks == free_before + 1
    kv.free(b)
    assert all(x in kv.pool.free_queue for x in shared)
    assert kv.pool.num_free_blocks == 15


def test_double_free_is_caught():
    pool = BlockPool(4)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)


# ------------------------------------------------------------------------------ prefix cache

def test_prefix_hit_on_identical_full_blocks_only():
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 3 * BS + 3))  # 3 full blocks + 2 tokens
    a = make_request(prompt, "a")
    assert compute(kv, a) == []
    b = make_request(prompt, "b")
    hits = compute(kv, b)
    assert hits == a.block_ids[:3]  # the partial 4th block is never shared
    assert b.num_computed_tokens == len(prompt)
    assert kv.prefix_hits == 3 * BS
    # Differing inside block 2 -> only the first block hits.
    c = make_request(prompt[:BS] + [500] + prompt[BS + 1:], "c")
    assert compute(kv, c) == a.block_ids[:1]


def test_chained_hash_same_block_after_different_prefix_misses():
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=True)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a = make_request(x + y + [0], "a")
    compute(kv, a)
    c = make_request(z + y + [0], "c")
    assert kv.get_computed_blocks(c) == []  # block y after prefix z is not block y after x
    assert hash_block(None, y) != hash_block(hash_block(None, x), y)
    assert hash_block(hash_block(None, x), y) == hash_block(hash_block(None, list(x)), tuple(y))


def test_full_hit_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 2 * BS + 1))  # exactly 2 full blocks
    a = make_request(prompt, "a")
    compute(kv, a)
    assert len(kv.pool.cached) == 2
    b = make_request(prompt, "b")
    hits = kv.get_computed_blocks(b)
    assert hits == a.block_ids[:1]
    assert b.num_tokens - len(hits) * BS >= 1
    # A single-block prompt never hits at all.
    c = make_request(prompt[:BS], "c")
    assert kv.get_computed_blocks(c) == []


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(1, 3 * BS + 1))
    compute(kv, make_request(prompt, "a"))
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_request(prompt, "b")) == []


def test_drop_from_cache_makes_block_unreachable():
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 2 * BS + 2))
    a = make_request(prompt, "a")
    compute(kv, a)
    first = a.block_ids[0]
    kv.pool.drop_from_cache(first)
    assert kv.pool.block_hash[first] is None
    assert first not in kv.pool.cached.values()
    # The chain breaks at the first block, so nothing after it is reachable either.
    assert kv.get_computed_blocks(make_request(prompt, "b")) == []
    # Dropping the second block instead keeps the first reachable.
    kv2 = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=True)
    a2 = make_request(prompt, "a2")
    compute(kv2, a2)
    kv2.pool.drop_from_cache(a2.block_ids[1])
    assert kv2.get_computed_blocks(make_request(prompt, "b2")) == a2.block_ids[:1]


# ------------------------------------------------------------------------------ LRU eviction

def test_lru_eviction_oldest_freed_first():
    kv = KVCacheManager(num_blocks=7, block_size=BS, enable_prefix_caching=True)  # 6 usable
    a = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")    # 3 blocks, 2 cached
    b = make_request([11, 12, 13, 14, 15, 16, 17, 18, 19], "b")
    compute(kv, a)
    compute(kv, b)
    assert kv.pool.num_free_blocks == 0
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    kv.free(a)
    kv.free(b)
    # a freed first -> its blocks are evicted first; within a request the tail goes first.
    assert list(kv.pool.free_queue) == a_blocks[::-1] + b_blocks[::-1]
    c = make_request([21, 22, 23, 24, 25], "c")
    assert kv.get_computed_blocks(c) == []
    assert kv.allocate_slots(c, 5)
    assert c.block_ids == [a_blocks[2], a_blocks[1]]
    # a's second block was evicted (uncached); its first block is still a hit.
    d = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], "d")
    assert kv.get_computed_blocks(d) == [a_blocks[0]]
    e = make_request([11, 12, 13, 14, 15, 16, 17, 18, 19], "e")
    assert kv.get_computed_blocks(e) == b_blocks[:2]


def test_cached_free_block_reused_by_hit_leaves_free_queue():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 2 * BS + 2))
    a = make_request(prompt, "a")
    compute(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    assert kv.pool.num_free_blocks == 7
    cached_blocks = [kv.pool.lookup(h) for h in a.block_hashes]
    assert cached_blocks == a_blocks[:2] and all(x in kv.pool.free_queue for x in cached_blocks)
    b = make_request(prompt, "b")
    hits = compute(kv, b)
    assert hits == cached_blocks
    assert all(x not in kv.pool.free_queue for x in hits)
    assert all(kv.pool.ref_counts[x] == 1 for x in hits)
    assert kv.pool.num_free_blocks == 7 - 3
    # Draining the pool cannot hand out a block b holds through the hit.
    rest = kv.pool.allocate(kv.pool.num_free_blocks)
    assert not set(rest) & set(b.block_ids)


def test_refreed_cached_block_moves_to_back_of_queue():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = make_request([1, 2, 3, 4, 5], "a")
    compute(kv, a)
    other = make_request([9, 9, 9, 9, 9], "o")
    compute(kv, other)
    a_first = a.block_ids[0]
    kv.free(a)
    kv.free(other)
    b = make_request([1, 2, 3, 4, 6], "b")
    assert compute(kv, b) == [a_first]
    hit_block = b.block_ids[0]
    kv.free(b)
    assert list(kv.pool.free_queue)[-1] == hit_block  # most recently freed: evicted last


# ------------------------------------------------------------------------------ allocate_slots

def test_allocate_slots_false_leaves_state_unchanged():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)  # 5 usable
    prompt = list(range(1, 2 * BS + 2))
    a = make_request(prompt, "a")
    compute(kv, a)
    kv.free(a)  # 2 cached blocks now sit free in the queue
    b = make_request(prompt + list(range(50, 50 + 3 * BS)), "b")  # needs 6 blocks in all
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    before = pool_state(kv.pool)
    req_before = (list(b.block_ids), b.num_computed_tokens, b.num_hashed_blocks)
    assert not kv.allocate_slots(b, b.num_tokens - 2 * BS, hits)
    assert pool_state(kv.pool) == before
    assert (list(b.block_ids), b.num_computed_tokens, b.num_hashed_blocks) == req_before
    # Exactly enough: 2 hit blocks (taken out of the free queue) + 3 new = 5.
    c = make_request(prompt + list(range(50, 50 + 2 * BS)), "c")
    hits = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - 2 * BS, hits)
    assert len(c.block_ids) == 5 and kv.pool.num_free_blocks == 0


def test_allocate_slots_grows_running_request_block_by_block():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    r = make_request([1, 2, 3], "r")
    compute(kv, r)
    assert len(r.block_ids) == 1
    for step in range(3 * BS - 3):
        r.all_token_ids.append(7)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        kv.cache_computed_blocks(r)
        assert len(r.block_ids) == -(-r.num_computed_tokens // BS)
    assert kv.pool.num_free_blocks == 0
    r.all_token_ids.append(7)
    before = pool_state(kv.pool)
    assert not kv.allocate_slots(r, 1)
    assert pool_state(kv.pool) == before and len(r.block_ids) == 3


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=14), st.booleans()),
                min_size=1, max_size=12))
def test_everything_freed_returns_whole_pool(prompts):
    """Random prompts (heavy prefix sharing), some freed mid-way: free == total - 1 at the end."""
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_prefix_caching=True)
    live = []
    for i, (prompt, free_now) in enumerate(prompts):
        r = make_request(prompt, f"r{i}")
        hits = kv.get_computed_blocks(r)
        if kv.allocate_slots(r, r.num_tokens - len(hits) * BS, hits):
            r.num_computed_tokens = r.num_tokens
            kv.cache_computed_blocks(r)
            assert NULL_BLOCK_ID not in r.block_ids
            assert len(r.block_ids) == -(-r.num_tokens // BS)
            (kv.free(r) if free_now else live.append(r))
    for r in live:
        kv.free(r)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1
    assert all(c == 0 for c in kv.pool.ref_counts)
    assert kv.pool.usage == 0.0
