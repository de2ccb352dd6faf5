// The AMX tile steps both AMX attention kernels run (cpu_attention_amx.cpp: decode, and
// cpu_prefill_attention_amx.cpp: prefill): S^T = K . Q^T with K's 16-key tiles as they lie in
// the paged cache and the queries packed as VNNI pairs.
#pragma once

#include <cstdint>

namespace kvsentry_amx {
constexpr int64_t kMaxDimBlocks = 4;  // head_dim <= 128: the query's tiles stay loaded (tiles 2-5)
}  // namespace kvsentry_amx

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

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
