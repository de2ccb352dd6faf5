// Paged prefill attention on the CPU, namespace `kvsentry`: each prefill request's new tokens
// attend causally to its whole sequence (a cached prefix and themselves), read out of the paged
// cache after this step's K/V were written.
//
//   torch.ops.kvsentry.paged_prefill_attention(out, query, key_cache, value_cache, block_tables,
//                                              seq_lens, query_starts, scale)
//
//   out           [T, Hq, Dv]: rows [query_starts[0], query_starts[R]) written
//   query         [T, Hq, D]
//   key_cache     [num_blocks, block_size, Hkv, D], any strides with the last dim contiguous
//   value_cache   [num_blocks, block_size, Hkv, Dv], the same
//   block_tables  [>= R, >= blocks of the longest] int32: row r is request r's blocks
//   seq_lens      int[R]: request r's length after this step; its new tokens are its last ones
//   query_starts  int[R + 1]: request r's new tokens are rows [query_starts[r], query_starts[r + 1])
//
// Two kernels behind it: on AMX-BF16 CPUs with a bf16 cache, cpu_prefill_attention_amx.cpp's
// tiles; anywhere else with AVX-512F, float32 or bf16, this file's vector tiles.
//
// Why: prefill used to run one query at a time through paged_decode_attention (every token
// re-reading its whole prefix: ~24 GFLOP/s, 1.5 s of a 4 x 512-token float32 prefill step of
// 5.6 s on a 1-core Xeon without AMX), and torch's SDPA is no faster on one core. The torch
// reference is engine/ops/attention.py's SDPA loop over the gathered K/V, which the tests hold
// both kernels to.
//
// The vector tiles, per (request, KV head): the sequence's K and V gathered into float32 rows
// once; then per tile of 16 lanes, a lane being one (new token, query head of the group) pair
// (16 / G tokens a tile, G the group), so the G heads that share a KV head share its loads:
//   scores   s[key] (one zmm: the lanes) = sum over d of K[key][d] x Q^T[d], eight keys at a
//            time, for the keys up to the tile's last token; scaled, masked causally per lane;
//   softmax  lane-wise over keys: no transposes; exp(s - max) (rounded to bf16 for a bf16
//            cache: the reference rounds its probabilities before the value product too);
//   values   O^T[d] = sum over keys of V[key][d] x P[key], 16 dims at a time, then written
//            token-major, divided by the lane's sum of weights.
// Causally masked keys get probability 0 and are multiplied (0 x NaN = NaN, as in the
// reference); positions past the length are never read.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attention_amx.h"
#include "cpu_fast_exp.h"
#include "cpu_quant_panels.h"

namespace {

using at::Tensor;
constexpr const char* kOp = "kvsentry::paged_prefill_attention";

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int64_t kKeys = 8;  // keys whose scores are summed at once: 8 chains hide the FMA latency

template <typename scalar_t>
struct Args {
  const scalar_t* q;
  int64_t qs0, qs1;
  const scalar_t* kc;
  int64_t ks0, ks1, ks2;
  const scalar_t* vc;
  int64_t vs0, vs1, vs2;
  const int32_t* tables;
  int64_t ts0, ts1;
  int64_t block_size, num_kv_heads, group, head_dim, v_dim;
  float scale;
  scalar_t* o;
  int64_t os0, os1;
  const int64_t* lens;
  const int64_t* starts;
};

// Rows [0, len) of one KV head of a paged cache into dst [rows][dim] float32; rows past len up
// to `rows` are zero (the score loop runs whole groups of kKeys keys).
template <typename scalar_t>
void gather_rows(const scalar_t* cache, int64_t s0, int64_t s1, int64_t s2, const int32_t* table, int64_t ts1,
                 int64_t block_size, int64_t h, int64_t len, int64_t rows, int64_t dim, float* dst) {
  for (int64_t pos = 0; pos < len; ++pos) {
    const int64_t j = pos / block_size;
    const scalar_t* src = cache + static_cast<int64_t>(table[j * ts1]) * s0 + (pos - j * block_size) * s1 + h * s2;
    float* row = dst + pos * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(src[d]);
  }
  std::fill(dst + len * dim, dst + rows * dim, 0.0f);
}

// s[key] for keys [k0, k0 + kKeys): the lanes' dot products with each key row, one zmm a key.
inline void score_keys(const float* kf, int64_t dim, const float* qt, float* s) {
  __m512 acc[kKeys];
  for (int i = 0; i < kKeys; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 q = _mm512_loadu_ps(qt + d * kLanes);
    for (int i = 0; i < kKeys; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(kf[i * dim + d]), q, acc[i]);
  }
  for (int i = 0; i < kKeys; ++i) _mm512_storeu_ps(s + i * kLanes, acc[i]);
}

// os[d0 + j] (one zmm a dim, the lanes) = sum over keys of V[key][d0 + j] x P[key], 16 dims.
inline void value_dims(const float* vf, int64_t v_dim, int64_t d0, const float* p, int64_t keys, float* os) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t key = 0; key < keys; ++key) {
    const __m512 w = _mm512_loadu_ps(p + key * kLanes);
    const float* v = vf + key * v_dim + d0;
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(v[j]), w, acc[j]);
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(os + (d0 + j) * kLanes, acc[j]);
}

// The same two for a bf16 cache on CPUs with AVX512-BF16: vdpbf16ps multiplies pairs of bf16
// (exactly) and adds them in float32, 32 products an instruction where an FMA does 16.
// Scores: s[key] += Q^T pair [d, d + 1] (the lanes) . the key's own pair, broadcast from its raw
// bf16 row. Values: os[d] += P pair [key, key + 1] (the lanes, bf16) . V^T pair [d] of those keys.
// Only the summation order (pairs) and denormal inputs (read as 0) differ from the float tiles.
__attribute__((target("avx512f,avx512bf16"))) void score_keys_bf16(const uint16_t* kb, int64_t dim,
                                                                  const uint32_t* qt2, float* s) {
  __m512 acc[kKeys];
  for (int i = 0; i < kKeys; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 2) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(qt2 + (d / 2) * kLanes);
    for (int i = 0; i < kKeys; ++i) {
      uint32_t pair;
      std::memcpy(&pair, kb + i * dim + d, 4);
      acc[i] = _mm512_dpbf16_ps(acc[i], q, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
    }
  }
  for (int i = 0; i < kKeys; ++i) _mm512_storeu_ps(s + i * kLanes, acc[i]);
}

// vt2 [pairs][v_dim]: the 32-bit pair (V[2k][d], V[2k + 1][d]); p2 [pairs][lanes] the same of P.
// `odd`: the last pair's second key is past the keys any lane sees, and is kept out (its V
// may be a real position's NaN, which a 0 probability would still spread).
__attribute__((target("avx512f,avx512bf16"))) void value_dims_bf16(const uint32_t* vt2, int64_t v_dim, int64_t d0,
                                                                  const uint32_t* p2, int64_t pairs, bool odd,
                                                                  float* os) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  const int64_t full = odd ? pairs - 1 : pairs;
  for (int64_t k = 0; k < full; ++k) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(p2 + k * kLanes);
    const uint32_t* v = vt2 + k * v_dim + d0;
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_dpbf16_ps(acc[j], w, (__m512bh)_mm512_set1_epi32(static_cast<int>(v[j])));
    }
  }
  if (odd) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(p2 + full * kLanes);
    const uint32_t* v = vt2 + full * v_dim + d0;
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_dpbf16_ps(acc[j], w, (__m512bh)_mm512_set1_epi32(static_cast<int>(v[j] & 0xFFFFu)));
    }
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(os + (d0 + j) * kLanes, acc[j]);
}

// Rows [0, len) of one KV head as they are (bf16) into dst [rows][dim], zero past len.
void gather_raw(const c10::BFloat16* cache, int64_t s0, int64_t s1, int64_t s2, const int32_t* table, int64_t ts1,
                int64_t block_size, int64_t h, int64_t len, int64_t rows, int64_t dim, uint16_t* dst) {
  for (int64_t pos = 0; pos < len; ++pos) {
    const int64_t j = pos / block_size;
    const auto* src = cache + static_cast<int64_t>(table[j * ts1]) * s0 + (pos - j * block_size) * s1 + h * s2;
    std::memcpy(dst + pos * dim, src, static_cast<size_t>(dim) * 2);
  }
  std::fill(dst + len * dim, dst + rows * dim, uint16_t{0});
}

// V^T pairs of one KV head straight from the paged cache: vt2[k][d] = V[2k][d] | V[2k + 1][d] << 16
// for rows [0, rows) (even), zero past len.
void gather_pairs(const c10::BFloat16* cache, int64_t s0, int64_t s1, int64_t s2, const int32_t* table, int64_t ts1,
                  int64_t block_size, int64_t h, int64_t len, int64_t rows, int64_t dim, uint32_t* vt2) {
  const auto row = [&](int64_t pos) -> const uint16_t* {
    if (pos >= len) return nullptr;
    const int64_t j = pos / block_size;
    return reinterpret_cast<const uint16_t*>(cache + static_cast<int64_t>(table[j * ts1]) * s0 +
                                             (pos - j * block_size) * s1 + h * s2);
  };
  for (int64_t k = 0; k < rows / 2; ++k) {
    const uint16_t* a = row(2 * k);
    const uint16_t* b = row(2 * k + 1);
    uint32_t* out = vt2 + k * dim;
    for (int64_t d = 0; d < dim; ++d) {
      out[d] = (a != nullptr ? a[d] : 0u) | (b != nullptr ? static_cast<uint32_t>(b[d]) << 16 : 0u);
    }
  }
}

// Q^T [dim][lanes] float32 from the lanes' query rows (element offsets `row` from q0); lanes
// outside `used` zero. bf16: one 32-bit gather per pair of dims, split into the two rows.
inline void load_queries(const float* q0, __m512i row, __mmask16 used, int64_t dim, float* qt) {
  for (int64_t d = 0; d < dim; ++d) {
    _mm512_storeu_ps(qt + d * kLanes, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), used, row, q0 + d, 4));
  }
}

inline void load_queries(const c10::BFloat16* q0, __m512i row, __mmask16 used, int64_t dim, float* qt) {
  for (int64_t d = 0; d < dim; d += 2) {
    const __m512i both = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), used, row, q0 + d, 2);
    _mm512_storeu_si512(qt + d * kLanes, _mm512_slli_epi32(both, 16));
    _mm512_storeu_si512(qt + (d + 1) * kLanes, _mm512_and_si512(both, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
}

// Q^T pairs [dim / 2][lanes]: each lane's (q[d], q[d + 1]) as one 32-bit bf16 pair.
inline void load_query_pairs(const c10::BFloat16* q0, __m512i row, __mmask16 used, int64_t dim, uint32_t* qt2) {
  for (int64_t d = 0; d < dim; d += 2) {
    _mm512_storeu_si512(qt2 + (d / 2) * kLanes, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), used, row, q0 + d, 2));
  }
}

// 16 float32 results into an output row: as they are, or rounded to bf16 as c10::BFloat16
// rounds (nearest even; NaN -> 0x7FC0).
inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }

inline void store16(c10::BFloat16* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), kvsentry_quant::to_bf16(v));
}

template <typename scalar_t>
void items(const Args<scalar_t>& a, int64_t begin, int64_t end) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  const int64_t group = a.group, per_tile = kLanes / group;  // tokens a tile
  std::vector<float> kf, vf, sc;
  std::vector<float> qt(static_cast<size_t>(a.head_dim * kLanes));  // [D][lanes]
  // The bf16 dot-product path: raw K rows, V^T and P as pairs of keys, Q^T pairs.
  const bool dot = kBf16 && a.head_dim % 2 == 0 && kvsentry_amx::bf16_dot_enabled();
  std::vector<uint16_t> kb;
  std::vector<uint32_t> vt2, p2, qt2(static_cast<size_t>((a.head_dim + 1) / 2 * kLanes));
  std::vector<float> os(static_cast<size_t>(a.v_dim * kLanes));     // [Dv][lanes]
  // os [dim][lane]: a lane's dims lie kLanes apart.
  const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(kLanes),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (int64_t item = begin; item < end; ++item) {
    const int64_t r = item / a.num_kv_heads, h = item % a.num_kv_heads;
    const int64_t len = a.lens[r], first = a.starts[r], num_new = a.starts[r + 1] - first;
    if (num_new <= 0) continue;
    const int64_t ctx = len - num_new;  // the first new token's position
    const int64_t rows = (len + kKeys - 1) / kKeys * kKeys;
    const int32_t* table = a.tables + r * a.ts0;
    sc.resize(static_cast<size_t>(rows * kLanes));
    if constexpr (kBf16) {
      if (dot) {
        kb.resize(static_cast<size_t>(rows * a.head_dim));
        vt2.resize(static_cast<size_t>(rows / 2 * a.v_dim));
        p2.resize(static_cast<size_t>(rows / 2 * kLanes));
        gather_raw(a.kc, a.ks0, a.ks1, a.ks2, table, a.ts1, a.block_size, h, len, rows, a.head_dim, kb.data());
        gather_pairs(a.vc, a.vs0, a.vs1, a.vs2, table, a.ts1, a.block_size, h, len, rows, a.v_dim, vt2.data());
      }
    }
    if (!dot) {
      kf.resize(static_cast<size_t>(rows * a.head_dim));
      vf.resize(static_cast<size_t>(rows * a.v_dim));
      gather_rows(a.kc, a.ks0, a.ks1, a.ks2, table, a.ts1, a.block_size, h, len, rows, a.head_dim, kf.data());
      gather_rows(a.vc, a.vs0, a.vs1, a.vs2, table, a.ts1, a.block_size, h, len, rows, a.v_dim, vf.data());
    }
    for (int64_t t0 = 0; t0 < num_new; t0 += per_tile) {
      const int64_t n = std::min(per_tile, num_new - t0);  // the tile's tokens
      const int64_t live = ctx + t0 + n;  // keys any lane sees
      // A lane's position; lanes past the tile's tokens see only key 0 (nothing overflows) and
      // are never stored. Q^T: lane l is token t0 + l / G of head h G + l % G.
      alignas(64) int32_t position[kLanes], row[kLanes];  // row: the lane's query row, in elements
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t t = l / group;
        position[l] = t < n ? static_cast<int32_t>(ctx + t0 + t) : 0;
        row[l] = t < n ? static_cast<int32_t>(t * a.qs0 + (l % group) * a.qs1) : 0;
      }
      const __mmask16 used = static_cast<__mmask16>((1u << (n * group)) - 1);
      const int64_t live_rows = (live + kKeys - 1) / kKeys * kKeys;
      if (dot) {
        if constexpr (kBf16) {
          load_query_pairs(a.q + (first + t0) * a.qs0 + h * group * a.qs1, _mm512_load_si512(row), used, a.head_dim,
                           qt2.data());
          for (int64_t k0 = 0; k0 < live_rows; k0 += kKeys) {
            score_keys_bf16(kb.data() + k0 * a.head_dim, a.head_dim, qt2.data(), sc.data() + k0 * kLanes);
          }
        }
      } else {
        load_queries(a.q + (first + t0) * a.qs0 + h * group * a.qs1, _mm512_load_si512(row), used, a.head_dim,
                     qt.data());
        for (int64_t k0 = 0; k0 < live_rows; k0 += kKeys) {
          score_keys(kf.data() + k0 * a.head_dim, a.head_dim, qt.data(), sc.data() + k0 * kLanes);
        }
      }
      const __m512i seen = _mm512_load_si512(position);
      // Scaled, causally masked, each lane's maximum.
      const __m512 best = kvsentry_math::scale_mask_max(sc.data(), live, seen, a.scale);
      // The sum divides the output instead of the probabilities (for bf16 the same rounding, relative).
      __m512 total = _mm512_setzero_ps();
      for (int64_t key = 0; key < live; ++key) {
        float* s = &sc[key * kLanes];
        __m512 p = kvsentry_math::softmax_exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s), best));
        total = _mm512_add_ps(total, p);
        if constexpr (kBf16) p = kvsentry_quant::round_to_bf16(p);
        _mm512_storeu_ps(s, p);
      }
      if (dot) {
        // The probabilities (bf16 values already) as pairs of keys, lane by lane; past `live`, 0.
        const int64_t pairs = (live + 1) / 2;
        for (int64_t k = 0; k < pairs; ++k) {
          const __m512i even = _mm512_srli_epi32(_mm512_loadu_si512(&sc[2 * k * kLanes]), 16);
          const __m512i odd = 2 * k + 1 < live ? _mm512_srli_epi32(_mm512_loadu_si512(&sc[(2 * k + 1) * kLanes]), 16)
                                               : _mm512_setzero_si512();
          _mm512_storeu_si512(&p2[k * kLanes], _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
        }
        for (int64_t d0 = 0; d0 < a.v_dim; d0 += 16) {
          value_dims_bf16(vt2.data(), a.v_dim, d0, p2.data(), pairs, live % 2 == 1, os.data());
        }
      } else {
        for (int64_t d0 = 0; d0 < a.v_dim; d0 += 16) value_dims(vf.data(), a.v_dim, d0, sc.data(), live, os.data());
      }
      alignas(64) float inv[kLanes];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
      for (int64_t l = 0; l < n * group; ++l) {
        scalar_t* orow = a.o + (first + t0 + l / group) * a.os0 + (h * group + l % group) * a.os1;
        for (int64_t d = 0; d < a.v_dim; d += 16) {
          store16(orow + d, _mm512_mul_ps(_mm512_i32gather_ps(column, &os[d * kLanes + l], 4), _mm512_set1_ps(inv[l])));
        }
      }
    }
  }
}

template <typename scalar_t>
void run(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
         const Tensor& block_tables, const std::vector<int64_t>& lens, const std::vector<int64_t>& starts, float scale) {
  const Args<scalar_t> a{query.data_ptr<scalar_t>(), query.stride(0), query.stride(1),
                         key_cache.data_ptr<scalar_t>(), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                         value_cache.data_ptr<scalar_t>(), value_cache.stride(0), value_cache.stride(1),
                         value_cache.stride(2), block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                         block_tables.stride(1), key_cache.size(1), key_cache.size(2),
                         query.size(1) / key_cache.size(2), query.size(2), value_cache.size(3), scale,
                         out.data_ptr<scalar_t>(), out.stride(0), out.stride(1), lens.data(), starts.data()};
  at::parallel_for(0, static_cast<int64_t>(lens.size()) * a.num_kv_heads, 1,
                   [&](int64_t begin, int64_t end) { items(a, begin, end); });
}
#endif

// Whether this file's vector tiles take these tensors: AVX-512F, every tensor float32 or every
// one bf16, head_dim and v_dim multiples of 16, at most 16 query heads per KV head.
bool vector_tiles_fit(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache) {
#if defined(__AVX512F__)
  const auto dtype = query.scalar_type();
  return (dtype == at::kFloat || dtype == at::kBFloat16) && key_cache.scalar_type() == dtype &&
         value_cache.scalar_type() == dtype && query.size(2) % 16 == 0 && value_cache.size(3) % 16 == 0 &&
         key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0 &&
         query.size(1) / key_cache.size(2) <= kLanes;
#else
  return false;
#endif
}

bool amx_fits(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache) {
  return kvsentry_amx::attention_amx_enabled() &&
         kvsentry_amx::prefill_attention_amx_fits(query, key_cache, value_cache);
}

bool paged_prefill_attention_fits(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache) {
  return query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4 &&
         (amx_fits(query, key_cache, value_cache) || vector_tiles_fit(query, key_cache, value_cache));
}

void check(const Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
           const Tensor& block_tables, at::IntArrayRef seq_lens, at::IntArrayRef query_starts) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, kOp,
              ": expects out/query [T, H, D] and caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              kOp, ": last dims must be contiguous");
  TORCH_CHECK(out.size(0) == query.size(0) && out.size(1) == query.size(1) && out.size(2) == value_cache.size(3),
              kOp, ": out must be [T, Hq, Dv]");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), kOp, ": out and query must share a dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, kOp, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2, kOp, ": block_tables must be int32 2-D");
  const int64_t num_reqs = static_cast<int64_t>(seq_lens.size());
  TORCH_CHECK(static_cast<int64_t>(query_starts.size()) == num_reqs + 1 && block_tables.size(0) >= num_reqs, kOp,
              ": query_starts must be [R + 1] and block_tables have R rows");
  TORCH_CHECK(paged_prefill_attention_fits(query, key_cache, value_cache), kOp,
              ": needs AVX-512F and float32 or bf16 tensors (one dtype), head_dim and v_dim multiples of 16 and at "
              "most 16 query heads per KV head, or AMX-BF16 (paged_prefill_attention_fits says so beforehand)");
  const int64_t num_blocks = key_cache.size(0);
  const int32_t* table = block_tables.data_ptr<int32_t>();
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t num_new = query_starts[r + 1] - query_starts[r];
    TORCH_CHECK(0 <= query_starts[r] && num_new >= 0 && query_starts[r + 1] <= query.size(0), kOp,
                ": query_starts must be ascending within the query's rows");
    TORCH_CHECK(num_new <= seq_lens[r], kOp, ": a request has more new tokens than its length");
    const int64_t blocks = (seq_lens[r] + key_cache.size(1) - 1) / key_cache.size(1);
    TORCH_CHECK(blocks <= block_tables.size(1), kOp, ": a request's length is past its block table's width");
    for (int64_t j = 0; j < blocks; ++j) {
      const int32_t entry = table[r * block_tables.stride(0) + j * block_tables.stride(1)];
      TORCH_CHECK(entry >= 0 && entry < num_blocks, kOp, ": block table entries must lie in [0, ", num_blocks,
                  "), got ", entry, " at [", r, ", ", j, "]");
    }
  }
}

void paged_prefill_attention_cpu(Tensor& out, const Tensor& query, const Tensor& key_cache,
                                 const Tensor& value_cache, const Tensor& block_tables, at::IntArrayRef seq_lens,
                                 at::IntArrayRef query_starts, double scale) {
  check(out, query, key_cache, value_cache, block_tables, seq_lens, query_starts);
  const std::vector<int64_t> lens(seq_lens.begin(), seq_lens.end());
  const std::vector<int64_t> starts(query_starts.begin(), query_starts.end());
  if (amx_fits(query, key_cache, value_cache)) {
    kvsentry_amx::prefill_attention_amx(out, query, key_cache, value_cache, block_tables, lens, starts,
                                        static_cast<float>(scale));
    return;
  }
#if defined(__AVX512F__)
  if (query.scalar_type() == at::kFloat) {
    run<float>(out, query, key_cache, value_cache, block_tables, lens, starts, static_cast<float>(scale));
  } else {
    run<c10::BFloat16>(out, query, key_cache, value_cache, block_tables, lens, starts, static_cast<float>(scale));
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, int[] seq_lens, int[] query_starts, float scale) -> ()");
  m.def("paged_prefill_attention_fits(Tensor query, Tensor key_cache, Tensor value_cache) -> bool",
        &paged_prefill_attention_fits);
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention_cpu); }
