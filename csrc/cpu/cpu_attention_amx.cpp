// Paged decode attention for a bfloat16 cache on CPUs with AMX-BF16: the same contract as
// cpu_attention.cpp's kernel (one query row per request, read straight out of the paged cache,
// the null block read like padding), its two products on AMX tiles. Called by
// paged_decode_attention for the shapes it takes (decode_attention_amx_fits); the vector
// kernel serves the rest.
//
// Why: at batch 64 on the default model (9 query heads over 3 KV heads of 64 dims) the vector
// kernel spent ~0.9 ms per layer on a 1-core Xeon, a third of the decode step, bound by its
// instruction count (16 vdpbf16ps and a 16-lane reduction per 16 keys and query head, then a
// widen and G FMAs per position for the values), not by memory. AMX does a 16 x 16 x 32
// product in one instruction.
//
// Per (request, KV head):
//   scores  S^T [16 keys, 16 heads] = K [16 keys, D] . Q^T: A is a 16-key tile of the cache as it
//           lies (rows ks1 apart), B the group's queries as VNNI pairs (built once per item;
//           heads past the group are zero); scaled, masked past the length and moved to the
//           per-head rows of probs, as the vector kernel's scores_tiled does.
//   softmax per head in float32 (the vector kernel's), then rounded to bf16 -- the torch
//           reference rounds its probabilities to the cache dtype before the value product too.
//   values  O [16 heads, Dv] = P [16 heads, 32 positions] . V: V's rows re-laid as VNNI pairs of
//           positions (unpacklo/hi of two rows: the dims come out shuffled within each 32, and
//           go back in order on the way out), 32 positions per tile, zero past the row's span;
//           rows past the group are zero in P and never stored.
// Masked positions get probability 0 and are still multiplied: 0 x NaN = NaN, so a NaN planted
// in block 0 spreads as it does through the reference and the vector kernel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_attention_amx.h"
#include "cpu_attention_amx_tiles.h"
#include "cpu_fast_exp.h"
#include "cpu_paged_prefetch.h"

namespace kvsentry_amx {

#if defined(__AVX512F__)
namespace {

// O [16 heads, 64 dims from d0] = P [16 heads, span] . V pairs, for `blocks` blocks of 32
// positions; stored to os [16][v_dim] float32 from column d0. `tiles` (1-4) 16-dim tiles.
__attribute__((target("amx-tile,amx-bf16"))) inline void value_tiles(const uint16_t* p, int64_t p_bytes,
                                                                    const uint16_t* vp, int64_t v_dim,
                                                                    int64_t d0, int64_t tiles, int64_t blocks,
                                                                    float* os) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t pair_bytes = v_dim * 4;  // one pair of positions: v_dim x 2 bf16
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint16_t* v = vp + (blk * kPairs * v_dim + d0) * 2;
    _tile_loadd(4, p + blk * 2 * kPairs, p_bytes);
    _tile_loadd(5, v, pair_bytes);
    _tile_dpbf16ps(0, 4, 5);
    if (tiles > 1) {
      _tile_loadd(6, v + 32, pair_bytes);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (tiles > 2) {
      _tile_loadd(7, v + 64, pair_bytes);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (tiles > 3) {
      _tile_loadd(5, v + 96, pair_bytes);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  const int64_t o_bytes = v_dim * 4;
  _tile_stored(0, os + d0, o_bytes);
  if (tiles > 1) _tile_stored(1, os + d0 + 16, o_bytes);
  if (tiles > 2) _tile_stored(2, os + d0 + 32, o_bytes);
  if (tiles > 3) _tile_stored(3, os + d0 + 48, o_bytes);
}

struct Args : PagedTensors {
  const int64_t* lens;
  const int32_t* reads;
  int64_t num_read;
};

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"))) void items(const Args& a, int64_t begin,
                                                                                 int64_t end) {
  const int64_t span = a.num_read * a.block_size;
  const int64_t span32 = (span + 2 * kPairs - 1) / (2 * kPairs) * (2 * kPairs);  // whole value tiles
  const int64_t blocks = a.head_dim / 32;
  TileBuffer<uint32_t> qt(static_cast<size_t>(blocks * kPairs * kTile), 0u);  // [block][pair][head]
  TileBuffer<float> probs(static_cast<size_t>(a.group * span32));
  TileBuffer<uint16_t> p(static_cast<size_t>(kTile * span32), 0);  // [16 heads][span32] bf16; rows >= group: 0
  TileBuffer<uint16_t> vp(static_cast<size_t>(span32 * a.v_dim));  // [span32 / 2][v_dim][2]
  TileBuffer<float> os(static_cast<size_t>(kTile * a.v_dim));
  TileBuffer<float> cs(static_cast<size_t>((span32 / kTile + 1) * kTile * kTile));  // S^T tiles, one spare
  // Every tile 16 rows of 64 bytes. Scores: C 0 and 6, K 1 and 7, Q^T 2-5; values: C 0-3, P 4, V 5-7.
  const TileConfig config({kTile, kTile, kPairs, kPairs, kPairs, kPairs, kPairs, kPairs});
  _tile_loadconfig(&config);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(kTile), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                                         9, 10, 11, 12, 13, 14, 15));
  // V pairs are interleaved within 128-bit lanes (unpacklo/hi_epi16: one instruction each), so
  // a 32-dim chunk's tile columns hold dims 8k + {0..3} (columns 4k..4k+3) and 8k + {4..7}
  // (columns 16 + 4k..): the output puts them back in order.
  const __m512i order_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i order_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
    const int64_t len = a.lens[b];
    const int64_t reads = a.reads != nullptr ? a.reads[b] : a.num_read;
    const int64_t row_span = reads * a.block_size;
    const int64_t row_span32 = (row_span + 2 * kPairs - 1) / (2 * kPairs) * (2 * kPairs);
    const int32_t* table = a.tables + b * a.ts0;
    // The group's queries as VNNI pairs: qt[block][pair][g] = q_g's dims (32 block + 2 pair, +1).
    for (int64_t g = 0; g < a.group; ++g) {
      const uint32_t* qrow = reinterpret_cast<const uint32_t*>(a.q + b * a.qs0 + (h * a.group + g) * a.qs1);
      for (int64_t pair = 0; pair < blocks * kPairs; ++pair) qt[pair * kTile + g] = qrow[pair];
    }
    load_query_tiles(qt.data(), blocks);  // every item: the value product reuses tiles 4 and 5
    // S^T tiles of the keys before the length (the rest are masked unread), two at a time,
    // into cs [tile][16 keys][16 heads].
    const int64_t live_tiles = (std::min(len, row_span) + kTile - 1) / kTile;
    auto key_rows = [&](int64_t tile) {
      const int64_t pos = tile * kTile, j = pos / a.block_size;
      return a.kc + static_cast<int64_t>(table[j * a.ts1]) * a.ks0 + h * a.ks2 + (pos - j * a.block_size) * a.ks1;
    };
    const auto ahead = kvsentry_paged::item_ahead(item, end, a.num_kv_heads, a.tables, a.ts0, a.ts1, a.reads,
                                                  a.num_read, a.kc, a.ks0, a.ks1, a.ks2, a.vc, a.vs0, a.vs1, a.vs2,
                                                  a.block_size, a.head_dim, a.v_dim);
    for (int64_t t = 0; t < live_tiles; t += 2) {
      const bool two = t + 1 < live_tiles;
      score_tiles(key_rows(t), two ? key_rows(t + 1) : nullptr, a.ks1 * 2, blocks, &cs[t * kTile * kTile],
                  &cs[(t + 1) * kTile * kTile]);
    }
    // Per head: scaled, masked past the length, the maximum (NaN wins, as in torch's max).
    float top[kTile];
    for (int64_t g = 0; g < a.group; ++g) {
      __m512 best = neg_inf;
      __mmask16 nan = 0;
      float* pr = &probs[g * span32];
      for (int64_t t = 0; t < live_tiles; ++t) {
        const int64_t pos0 = t * kTile, live_n = std::min<int64_t>(kTile, len - pos0);
        const __mmask16 live = live_n == kTile ? 0xFFFF : static_cast<__mmask16>((1u << live_n) - 1);
        __m512 sc = _mm512_i32gather_ps(column, &cs[t * kTile * kTile + g], 4);
        sc = _mm512_mask_blend_ps(live, neg_inf, _mm512_mul_ps(sc, scale));
        nan |= _mm512_cmp_ps_mask(sc, sc, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, sc);
        _mm512_storeu_ps(pr + pos0, sc);
      }
      for (int64_t pos0 = live_tiles * kTile; pos0 < row_span; pos0 += kTile) _mm512_storeu_ps(pr + pos0, neg_inf);
      top[g] = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(best);
    }
    // Softmax per head over the row's span (masked positions: exactly 0), rounded to bf16;
    // zero from the span to the whole value tile.
    for (int64_t g = 0; g < a.group; ++g) {
      float* pr = &probs[g * span32];
      __m512 total_v = _mm512_setzero_ps();
      for (int64_t pos = 0; pos < row_span; ++pos) pr[pos] = kvsentry_math::fast_exp(pr[pos] - top[g]);
      for (int64_t pos = 0; pos < row_span; pos += kTile) total_v = _mm512_add_ps(total_v, _mm512_loadu_ps(pr + pos));
      const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(total_v));
      uint16_t* prow = &p[g * span32];
      for (int64_t pos = 0; pos < row_span; pos += kTile) {
        const __m256bh bf = _mm512_cvtneps_pbh(_mm512_div_ps(_mm512_loadu_ps(pr + pos), total));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + pos), (__m256i)bf);
      }
      std::fill(prow + row_span, prow + row_span32, 0);
    }
    // V as VNNI pairs of positions, zero past the span; meanwhile an item ahead's blocks go
    // to L2 (cpu_paged_prefetch.h).
    for (int64_t j = 0; j < reads; ++j) {
      ahead.block(j);
      const uint16_t* vblock = reinterpret_cast<const uint16_t*>(a.vc + static_cast<int64_t>(table[j * a.ts1]) * a.vs0 +
                                                                 h * a.vs2);
      for (int64_t t = 0; t < a.block_size; t += 2) {
        const uint16_t* r0 = vblock + t * a.vs1;
        const uint16_t* r1 = r0 + a.vs1;
        uint16_t* dst = &vp[((j * a.block_size + t) / 2) * a.v_dim * 2];
        for (int64_t d = 0; d < a.v_dim; d += 32) {
          const __m512i x0 = _mm512_loadu_si512(r0 + d), x1 = _mm512_loadu_si512(r1 + d);
          _mm512_storeu_si512(dst + 2 * d, _mm512_unpacklo_epi16(x0, x1));
          _mm512_storeu_si512(dst + 2 * d + 32, _mm512_unpackhi_epi16(x0, x1));
        }
      }
    }
    for (int64_t j = reads; j < ahead.reads; ++j) ahead.block(j);  // an item ahead's blocks past ours
    std::fill(vp.begin() + row_span * a.v_dim, vp.begin() + row_span32 * a.v_dim, 0);
    for (int64_t d0 = 0; d0 < a.v_dim; d0 += 4 * kTile) {
      value_tiles(p.data(), span32 * 2, vp.data(), a.v_dim, d0, std::min<int64_t>(4, (a.v_dim - d0) / kTile),
                  row_span32 / (2 * kPairs), os.data());
    }
    for (int64_t g = 0; g < a.group; ++g) {
      c10::BFloat16* orow = a.o + b * a.os0 + (h * a.group + g) * a.os1;
      const float* src = &os[g * a.v_dim];
      for (int64_t d = 0; d < a.v_dim; d += 2 * kTile) {
        const __m512 lo = _mm512_loadu_ps(src + d), hi = _mm512_loadu_ps(src + d + kTile);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, order_lo, hi)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + d + kTile),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, order_hi, hi)));
      }
    }
  }
  _tile_release();
}

}  // namespace
#endif

bool decode_attention_amx_fits(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  return tile_shapes_fit(query, key_cache, value_cache) && query.size(1) / key_cache.size(2) <= 16;
}

void decode_attention_amx(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const int32_t* read_blocks, int64_t num_read, float scale) {
#if defined(__AVX512F__)
  const Args a{paged_tensors(out, query, key_cache, value_cache, block_tables, scale), seq_lens.data_ptr<int64_t>(),
               read_blocks, num_read};
  at::parallel_for(0, query.size(0) * a.num_kv_heads, 1,
                   [&](int64_t begin, int64_t end) { items(a, begin, end); });
#else
  TORCH_CHECK(false, "kvsentry::paged_decode_attention: this build has no AMX path");
#endif
}

}  // namespace kvsentry_amx
