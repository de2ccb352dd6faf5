// The AMX tile steps both AMX attention kernels run (cpu_attention_amx.cpp: decode, and
// cpu_prefill_attention_amx.cpp: prefill): S^T = K . Q^T with K's 16-key tiles as they lie in
// the paged cache and the queries packed as VNNI pairs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

#include "cpu_amx.h"

namespace kvsentry_amx {
constexpr int64_t kMaxDimBlocks = 4;  // head_dim <= 128: the query's tiles stay loaded (tiles 2-5)

// The shapes both kernels take: an AMX-BF16 CPU (and build), bf16 queries, head_dim a multiple
// of 32 up to 128, v_dim a multiple of 32, blocks of a multiple of 16 tokens.
inline bool tile_shapes_fit(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  return supported() && query.scalar_type() == at::kBFloat16 && query.size(2) % 32 == 0 &&
         query.size(2) <= 32 * kMaxDimBlocks && value_cache.size(3) % 32 == 0 && key_cache.size(1) % 16 == 0;
}

// What both kernels read of their tensors, as raw pointers and element strides: out and query
// [T, Hq, D(v)], the caches [num_blocks, block_size, Hkv, D(v)], block_tables [R, W] int32.
struct PagedTensors {
  const c10::BFloat16* q;
  int64_t qs0, qs1;
  const c10::BFloat16* kc;
  int64_t ks0, ks1, ks2;
  const c10::BFloat16* vc;
  int64_t vs0, vs1, vs2;
  const int32_t* tables;
  int64_t ts0, ts1;
  int64_t block_size, num_kv_heads, group, head_dim, v_dim;
  float scale;
  c10::BFloat16* o;
  int64_t os0, os1;
};

inline PagedTensors paged_tensors(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables, float scale) {
  return {query.data_ptr<c10::BFloat16>(), query.stride(0), query.stride(1),
          key_cache.data_ptr<c10::BFloat16>(), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
          value_cache.data_ptr<c10::BFloat16>(), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
          block_tables.data_ptr<int32_t>(), block_tables.stride(0), block_tables.stride(1),
          key_cache.size(1), key_cache.size(2), query.size(1) / key_cache.size(2), query.size(2), value_cache.size(3),
          scale, out.data_ptr<c10::BFloat16>(), out.stride(0), out.stride(1)};
}
}  // namespace kvsentry_amx

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kvsentry_amx {

constexpr int64_t kTile = 16;       // keys per score tile, heads per tile, dims per value tile
constexpr int64_t kPairs = 16;      // pairs of the reduced dimension per B tile (32 values)

// S^T for 16 keys (and, when k1 is set, 16 more): C tile 0 (6) = the A tile 1 (7) of K rows
// [k, k + 16 ks1) . the Q^T tiles 2..(1 + blocks); stored to cs [16 keys][16 heads] float32
// (c1: the second). Two key tiles in flight hide a product's latency behind the other's.
__attribute__((target("amx-tile,amx-bf16"))) inline void score_tiles(const c10::BFloat16* k0,
                                                                    const c10::BFloat16* k1, int64_t k_bytes,
                                                                    int64_t blocks, float* c0, float* c1) {
  _tile_zero(0);
  _tile_zero(6);
  // Dims [32 b, 32 b + 32) of both key tiles against the query tile q = 2 + b. A macro, not a
  // loop: AMX instructions take their tile numbers as literals (the intrinsics paste them).
#define KVS_SCORE_BLOCK(b, q)                                         \
  if (blocks > (b)) {                                                 \
    _tile_loadd(1, k0 + 32 * (b), k_bytes);                           \
    if (k1 != nullptr) _tile_loadd(7, k1 + 32 * (b), k_bytes);        \
    _tile_dpbf16ps(0, 1, q);                                          \
    if (k1 != nullptr) _tile_dpbf16ps(6, 7, q);                       \
  }
  KVS_SCORE_BLOCK(0, 2)
  KVS_SCORE_BLOCK(1, 3)
  KVS_SCORE_BLOCK(2, 4)
  KVS_SCORE_BLOCK(3, 5)
#undef KVS_SCORE_BLOCK
  _tile_stored(0, c0, kTile * 4);
  if (k1 != nullptr) _tile_stored(6, c1, kTile * 4);
}

__attribute__((target("amx-tile"))) inline void load_query_tiles(const uint32_t* qt, int64_t blocks) {
  _tile_loadd(2, qt, kTile * 4);
  if (blocks > 1) _tile_loadd(3, qt + kPairs * kTile, kTile * 4);
  if (blocks > 2) _tile_loadd(4, qt + 2 * kPairs * kTile, kTile * 4);
  if (blocks > 3) _tile_loadd(5, qt + 3 * kPairs * kTile, kTile * 4);
}

}  // namespace kvsentry_amx
#endif
