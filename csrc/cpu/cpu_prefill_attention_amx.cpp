// The AMX path of paged_prefill_attention (cpu_prefill_attention.cpp has the op, its contract
// and its checks) for a bfloat16 cache on CPUs with AMX-BF16: each prefill request's new tokens
// attend causally to its whole sequence, read straight out of the paged cache.
//
// Why: torch's flash SDPA ran the default model's 512-token causal prefill at ~140 GFLOP/s on a
// 1-core Xeon (a quarter of a 4 x 512 prefill step), where the AMX tiles do 1024 FLOP a cycle.
// The torch reference is engine/ops/attention.py's SDPA loop over the gathered K/V, which the
// tests hold this to.
//
// Per (request, KV head): V^T packed once ([Dv][positions], zero past the length), then per tile
// of 16 new tokens and per query head of the group:
//   scores  S^T [16 keys, 16 tokens] = K . Q^T (cpu_attention_amx_tiles.h: K's tiles as they lie
//           in the cache, the tokens' queries as VNNI pairs) for the keys up to the tile's last
//           token; scaled and masked causally, one zmm per key with the tokens as lanes, so the
//           softmax's max and sum are lane-wise over keys and need no transposes;
//   softmax over each token's keys in float32: exp(s - max) rounded to bf16 (the reference rounds
//           its probabilities before the value product too) and interleaved into VNNI key pairs;
//   values  O^T [Dv, 16 tokens] = V^T . P^T on AMX tiles, then written token-major, divided by
//           the token's sum of weights.
// Causally masked keys get probability 0 and are multiplied (0 x NaN = NaN, as in the
// reference); positions past the length are never read.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_attention_amx.h"
#include "cpu_attention_amx_tiles.h"
#include "cpu_fast_exp.h"

namespace {

using at::Tensor;

#if defined(__AVX512F__)
using kvsentry_amx::kPairs;
using kvsentry_amx::kTile;
using kvsentry_amx::TileBuffer;

struct Args : kvsentry_amx::PagedTensors {
  const int64_t* lens;
  const int64_t* starts;
};

// O^T [64 dims from d0, 16 tokens] = V^T [dims, keys] . P^T pairs over `blocks` blocks of 32 keys;
// stored to os [v_dim][16] float32 from row d0. `tiles` (1-4) 16-dim tiles.
__attribute__((target("amx-tile,amx-bf16"))) inline void value_tiles_t(const uint16_t* vt, int64_t vt_bytes,
                                                                      const uint16_t* pt, int64_t d0, int64_t tiles,
                                                                      int64_t blocks, float* os) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t row = vt_bytes / 2;  // V^T's row length in elements
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint16_t* a = vt + d0 * row + blk * 2 * kPairs;
    _tile_loadd(4, pt + blk * kPairs * 2 * kTile, 2 * kTile * 2);
    _tile_loadd(5, a, vt_bytes);
    _tile_dpbf16ps(0, 5, 4);
    if (tiles > 1) {
      _tile_loadd(6, a + kTile * row, vt_bytes);
      _tile_dpbf16ps(1, 6, 4);
    }
    if (tiles > 2) {
      _tile_loadd(7, a + 2 * kTile * row, vt_bytes);
      _tile_dpbf16ps(2, 7, 4);
    }
    if (tiles > 3) {
      _tile_loadd(5, a + 3 * kTile * row, vt_bytes);
      _tile_dpbf16ps(3, 5, 4);
    }
  }
  _tile_stored(0, os + d0 * kTile, kTile * 4);
  if (tiles > 1) _tile_stored(1, os + (d0 + kTile) * kTile, kTile * 4);
  if (tiles > 2) _tile_stored(2, os + (d0 + 2 * kTile) * kTile, kTile * 4);
  if (tiles > 3) _tile_stored(3, os + (d0 + 3 * kTile) * kTile, kTile * 4);
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"))) void items(const Args& a, int64_t begin,
                                                                                 int64_t end) {
  const int64_t blocks = a.head_dim / 32;
  TileBuffer<uint16_t> vt;  // [v_dim][len32] V^T of the item's sequence
  TileBuffer<float> sc;  // [keys][16 tokens] scores, then probabilities
  TileBuffer<uint16_t> pt;  // [len32 / 2][16 tokens][2] P^T as VNNI key pairs
  TileBuffer<uint32_t> qt(static_cast<size_t>(blocks * kPairs * kTile));  // [block][pair][token]
  TileBuffer<float> os(static_cast<size_t>(a.v_dim * kTile));  // [v_dim][16 tokens]
  // Every tile 16 rows of 64 bytes. Scores: C 0 and 6, K 1 and 7, Q^T 2-5; values: C 0-3, P^T 4, V^T 5-7.
  const kvsentry_amx::TileConfig config({kTile, kTile, kPairs, kPairs, kPairs, kPairs, kPairs, kPairs});
  _tile_loadconfig(&config);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // cvtne2ps_pbh(odd, even) puts the even key's 16 tokens below the odd key's; VNNI wants them paired.
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(kTile), lane);  // os [dim][token]: a token's dims
  const __m512i token_rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(a.qs0 * 2)));  // bytes
  for (int64_t item = begin; item < end; ++item) {
    const int64_t r = item / a.num_kv_heads, h = item % a.num_kv_heads;
    const int64_t len = a.lens[r], first = a.starts[r], num_new = a.starts[r + 1] - first;
    if (num_new <= 0) continue;
    const int64_t ctx = len - num_new;  // the first new token's position
    const int64_t len32 = (len + 2 * kPairs - 1) / (2 * kPairs) * (2 * kPairs);
    const int32_t* table = a.tables + r * a.ts0;
    // V^T, zero past the length (never read from the cache: the reference stops there too):
    // per 16 positions of a block and pair of dims, one 32-bit gather of the (d, d + 1) pairs,
    // split into the two rows (a scalar transpose was a tenth of the kernel's time).
    vt.assign(static_cast<size_t>(a.v_dim * len32), 0);
    const __m512i rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(a.vs1 * 2)));  // bytes
    for (int64_t pos = 0; pos < len; pos += kTile) {
      const int64_t j = pos / a.block_size, n = std::min<int64_t>(kTile, len - pos);
      const __mmask16 live = n == kTile ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      const c10::BFloat16* first_row =
          a.vc + static_cast<int64_t>(table[j * a.ts1]) * a.vs0 + h * a.vs2 + (pos - j * a.block_size) * a.vs1;
      for (int64_t d = 0; d < a.v_dim; d += 2) {
        const __m512i both = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, first_row + d, 1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&vt[d * len32 + pos]), _mm512_cvtepi32_epi16(both));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&vt[(d + 1) * len32 + pos]),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(both, 16)));
      }
    }
    sc.resize(static_cast<size_t>(len32 * kTile));
    pt.resize(static_cast<size_t>(len32 * kTile));
    auto key_rows = [&](int64_t tile) {
      const int64_t pos = tile * kTile, j = pos / a.block_size;
      return a.kc + static_cast<int64_t>(table[j * a.ts1]) * a.ks0 + h * a.ks2 + (pos - j * a.block_size) * a.ks1;
    };
    for (int64_t t0 = 0; t0 < num_new; t0 += kTile) {
      const int64_t n = std::min<int64_t>(kTile, num_new - t0);
      const int64_t live = ctx + t0 + n;  // keys any token of the tile sees
      const int64_t live_tiles = (live + kTile - 1) / kTile;
      const int64_t live32 = (live + 2 * kPairs - 1) / (2 * kPairs) * (2 * kPairs);
      const __m512i position = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(ctx + t0)), lane);
      // Tokens past the tile's last: never stored; their lanes see only key 0 so nothing overflows.
      const __m512i seen = _mm512_mask_blend_epi32(static_cast<__mmask16>((1u << n) - 1), _mm512_setzero_si512(),
                                                   position);
      const __mmask16 tokens = static_cast<__mmask16>((1u << n) - 1);
      for (int64_t g = 0; g < a.group; ++g) {
        const int64_t head = h * a.group + g;
        // Q^T as VNNI pairs: row `pair` holds each token's dims (2 pair, 2 pair + 1), one 32-bit
        // gather per row from the tile's token rows; tokens past the tile's last are zero.
        const c10::BFloat16* q0 = a.q + (first + t0) * a.qs0 + head * a.qs1;
        for (int64_t pair = 0; pair < blocks * kPairs; ++pair) {
          _mm512_storeu_si512(&qt[pair * kTile],
                              _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), tokens, token_rows, q0 + 2 * pair, 1));
        }
        kvsentry_amx::load_query_tiles(qt.data(), blocks);
        for (int64_t t = 0; t < live_tiles; t += 2) {
          const bool two = t + 1 < live_tiles;
          kvsentry_amx::score_tiles(key_rows(t), two ? key_rows(t + 1) : nullptr, a.ks1 * 2, blocks,
                                    &sc[t * kTile * kTile], &sc[(t + 1) * kTile * kTile]);
        }
        // Scaled, causally masked, each lane's maximum.
        const __m512 best = kvsentry_math::scale_mask_max(sc.data(), live, seen, a.scale);
        // exp(s - max) rounded to bf16 and interleaved into VNNI key pairs in one pass; the sum
        // divides the output instead of the probabilities (the same bf16 rounding, relative).
        __m512 total = _mm512_setzero_ps();
        for (int64_t key = 0; key < live32; key += 2) {
          __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
          if (key < live) even = kvsentry_math::softmax_exp_ps(_mm512_sub_ps(_mm512_loadu_ps(&sc[key * kTile]), best));
          if (key + 1 < live) odd = kvsentry_math::softmax_exp_ps(_mm512_sub_ps(_mm512_loadu_ps(&sc[(key + 1) * kTile]), best));
          total = _mm512_add_ps(total, _mm512_add_ps(even, odd));
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
          _mm512_storeu_si512(&pt[key * kTile], _mm512_permutexvar_epi16(pairs, both));
        }
        alignas(64) float inv[kTile];
        _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
        for (int64_t d0 = 0; d0 < a.v_dim; d0 += 4 * kTile) {
          value_tiles_t(vt.data(), len32 * 2, pt.data(), d0, std::min<int64_t>(4, (a.v_dim - d0) / kTile),
                        live32 / (2 * kPairs), os.data());
        }
        for (int64_t t = 0; t < n; ++t) {
          c10::BFloat16* orow = a.o + (first + t0 + t) * a.os0 + head * a.os1;
          for (int64_t d = 0; d < a.v_dim; d += kTile) {
            const __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(column, &os[d * kTile + t], 4), _mm512_set1_ps(inv[t]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + d), (__m256i)_mm512_cvtneps_pbh(v));
          }
        }
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace

namespace kvsentry_amx {

void prefill_attention_amx(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const std::vector<int64_t>& lens, const std::vector<int64_t>& starts, float scale) {
#if defined(__AVX512F__)
  const Args a{paged_tensors(out, query, key_cache, value_cache, block_tables, scale), lens.data(), starts.data()};
  at::parallel_for(0, static_cast<int64_t>(lens.size()) * a.num_kv_heads, 1,
                   [&](int64_t begin, int64_t end) { items(a, begin, end); });
#endif
}

bool prefill_attention_amx_fits(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  return tile_shapes_fit(query, key_cache, value_cache) && key_cache.scalar_type() == at::kBFloat16 &&
         value_cache.scalar_type() == at::kBFloat16;
}

}  // namespace kvsentry_amx
