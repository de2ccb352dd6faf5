// What the decode attention kernels (cpu_attention.cpp, cpu_attention_amx.cpp) ask of memory
// ahead of time, about the (request, KV head) item kAheadItems after the current one.
//
// Why: a decode step reads each live block-head once, from DRAM, and the hardware prefetcher
// only streams within a run of adjacent lines it has seen touched; the blocks of a sequence
// lie wherever the pool had them free.
//   - The AMX kernel asks for every line of the item's K and V block-heads, into L2, one block
//     per block of its own V relayout (`block`). Batch 64 x 155 tokens over 30 layers of the
//     default model's shapes, 1-core Xeon, alternating in one process: blocks in order
//     854-896 -> 859-884 us/layer (neutral), scattered 1333-1397 -> 1184-1238, scattered pairs
//     1365-1419 -> 1102-1183. The same prefetches issued all at the item's start stalled on
//     full miss queues (seq 895 vs 837).
//   - The vector kernel's tiled scores (AVX-512) ask for one of the item ahead's blocks per
//     block of their own, as the AMX kernel does. Batch 64 x 132 tokens over 30 layers of the
//     default model's shapes, bf16, a 1-core Zen 5 EPYC: scattered blocks 545 -> 424-442
//     us/layer, blocks in order 285-313 -> 294-304 (neutral); 250 us/layer from cache.
//   - The untiled float32/vector path touches only the first line of each block-head
//     (`first_lines`; 1625 -> 1371 us/layer when it came in): its L2 variant measured 4-7%
//     slower there, on a Xeon.
#pragma once

#include <cstdint>

#include "cpu_prefetch.h"

namespace kvsentry_paged {

constexpr int64_t kAheadItems = 2;

// The item kAheadItems after `item` (none at or past `end`): items are (request b, KV head h)
// = (item / num_kv_heads, item % num_kv_heads); row b of the tables reads read_blocks[b]
// entries (num_read without read_blocks). Caches are [num_blocks, block_size, Hkv, D] by
// strides (s0 block, s1 token, s2 head); a block-head is block_size rows of `row_bytes`.
template <typename scalar_t>
struct ItemAhead {
  const int32_t* table = nullptr;  // the item's row of the block tables; nullptr: no item
  int64_t ts1 = 0, reads = 0, h = 0;
  const scalar_t *kc, *vc;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2, block_size, k_row_bytes, v_row_bytes;

  // The first line of each of the item's K and V block-heads, into L1.
  void first_lines() const {
    for (int64_t j = 0; j < reads && table != nullptr; ++j) {
      const int64_t blk = table[j * ts1];
      __builtin_prefetch(kc + blk * ks0 + h * ks2);
      __builtin_prefetch(vc + blk * vs0 + h * vs2);
    }
  }

  // Every line of block j's K and V block-heads into L2 (nothing for j past the item's blocks).
  void block(int64_t j) const {
    if (table == nullptr || j >= reads) return;
    const int64_t blk = table[j * ts1];
    const char* k = reinterpret_cast<const char*>(kc + blk * ks0 + h * ks2);
    const char* v = reinterpret_cast<const char*>(vc + blk * vs0 + h * vs2);
    for (int64_t t = 0; t < block_size; ++t) {
      const char* kr = k + t * ks1 * static_cast<int64_t>(sizeof(scalar_t));
      const char* vr = v + t * vs1 * static_cast<int64_t>(sizeof(scalar_t));
      for (int64_t o = 0; o < k_row_bytes; o += 64) kvsentry_mem::prefetch_l2(kr + o);
      for (int64_t o = 0; o < v_row_bytes; o += 64) kvsentry_mem::prefetch_l2(vr + o);
    }
  }
};

template <typename scalar_t>
ItemAhead<scalar_t> item_ahead(int64_t item, int64_t end, int64_t num_kv_heads, const int32_t* tables, int64_t ts0,
                               int64_t ts1, const int32_t* read_blocks, int64_t num_read, const scalar_t* kc,
                               int64_t ks0, int64_t ks1, int64_t ks2, const scalar_t* vc, int64_t vs0, int64_t vs1,
                               int64_t vs2, int64_t block_size, int64_t head_dim, int64_t v_dim) {
  ItemAhead<scalar_t> a{nullptr, ts1, 0, 0, kc, vc, ks0, ks1, ks2, vs0, vs1, vs2, block_size,
                        head_dim * static_cast<int64_t>(sizeof(scalar_t)),
                        v_dim * static_cast<int64_t>(sizeof(scalar_t))};
  item += kAheadItems;
  if (item >= end) return a;
  const int64_t b = item / num_kv_heads;
  a.table = tables + b * ts0;
  a.h = item % num_kv_heads;
  a.reads = read_blocks != nullptr ? read_blocks[b] : num_read;
  return a;
}

}  // namespace kvsentry_paged
