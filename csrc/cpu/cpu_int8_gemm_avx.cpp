// The int8-activation GEMM of GGUF blocks on AVX-VNNI: the VEX-encoded 256-bit `vpdpbusd` of CPUs
// without AVX-512 (Intel's client cores from Alder Lake on, for instance), against the
// same blocks int8_gemm_pack lays out for the AVX512-VNNI kernel (cpu_int8_gemm.cpp, whose op
// quantizes the activations here and calls this). No second packing: a group's 16 outputs lie in
// a 64-byte vector as 4 bytes each, so its first 8 outputs are the vector's low 32 bytes and the
// last 8 its high 32, and each half is one 256-bit vector of 8 int32 lanes.
//
// Every output lane runs the AVX-512 kernel's float32 operations in its order, each product and
// sum rounded on its own: a product that a sum takes passes through `rounded` (an empty asm
// statement), since GCC contracts a multiply and an add of vector types into an FMA where it may
// (-ffp-contract=fast, C++'s default), and the AVX-512 kernel's *_round_ps intrinsics do not.
// The activations quantize as there too: round to nearest even (MXCSR's default, which
// _mm512_cvt_roundps_epi32 names), and the int32 -> int8 narrowing keeps the low byte as vpmovdb.
// So a row's bits are the same whichever kernel the CPU picks (tests/csrc/test_int8_gemm.py runs
// both on CPUs that have both).
//
// A tile: H halves (8 outputs each; one group's 2) x R batch rows; each weight vector serves R
// rows, each activation broadcast H halves. Measured against the
// AVX512-VNNI kernel on the same CPU: docs/kernels.md.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "cpu_int8_gemm.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvsentry_int8 {

#if defined(__x86_64__)
namespace {

using namespace layout;

#define KVS_AVX_VNNI_TARGET __attribute__((target("avx2,avxvnni,f16c,fma")))

// A product that is its own float32 rounding: the empty asm hides it from contraction into an FMA.
KVS_AVX_VNNI_TARGET __attribute__((always_inline)) inline __m256 rounded(__m256 product) {
  asm("" : "+v"(product));
  return product;
}
KVS_AVX_VNNI_TARGET __attribute__((always_inline)) inline __m256 mul(__m256 a, __m256 b) {
  return rounded(_mm256_mul_ps(a, b));
}

// The low byte of each int32 lane of v [8] into 8 bytes (vpmovdb's truncation).
KVS_AVX_VNNI_TARGET __attribute__((always_inline)) inline __m128i low_bytes(__m256i v) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(v, pick);  // each 128-bit lane's 4 in its int32 0
  return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0)));
}

KVS_AVX_VNNI_TARGET __attribute__((always_inline)) inline int32_t add_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// 8 bytes at p widened to float32: unsigned (Q4_K's 6-bit scales) or signed (Q6_K's).
template <bool kSigned>
KVS_AVX_VNNI_TARGET __attribute__((always_inline)) inline __m256 bytes_to_floats(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

// 8 float16 at p widened to float32.
KVS_AVX_VNNI_TARGET __attribute__((always_inline)) inline __m256 halfs(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Half h of a group: its float16 scales start 16 (h % 2) bytes into the group's 16, its byte
// scales 8 (h % 2) into 16, its quants 32 (h % 2) into each 64-byte vector.

// Half h's 32 bytes of the 64-byte vector `offset` bytes from q.
KVS_AVX_VNNI_TARGET __attribute__((always_inline)) inline __m256i quant_half(const uint8_t* q, int h, int64_t offset) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + offset + 32 * (h % 2)));
}

// The lanes 0 .. lanes - 1 of a masked load or store.
KVS_AVX_VNNI_TARGET __attribute__((always_inline)) inline __m256i first_lanes(int lanes) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

KVS_AVX_VNNI_TARGET void quantize_row(const float* x, int64_t blocks, QuantRow out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
    const __m256 most = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dx = amax / 127.0f;  // a division, as torch's (and the AVX-512 kernel's)
    const float inverse = dx != 0.0f ? 1.0f / dx : 0.0f;
    const __m256 scale = _mm256_set1_ps(inverse);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(mul(v[i], scale));  // rounded to nearest even, as torch.round
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out.q + 32 * b + 8 * i), low_bytes(q[i]));
    }
    const int32_t half = add_lanes(_mm256_add_epi32(q[0], q[1]));
    const int32_t sum = half + add_lanes(_mm256_add_epi32(q[2], q[3]));
    out.dx[b] = dx;
    out.sum[b] = sum;
    out.half[b] = half;
    out.sx[b] = dx * static_cast<float>(sum);
  }
}

// Outputs of H halves (half h: group h / 2's outputs 8 (h % 2) .. + 7, groups `stride` bytes
// apart from `w`) for R batch rows: y[r][8 h + lane], the first `valid` of them stored.
template <int64_t kType, int H, int R>
KVS_AVX_VNNI_TARGET void tile(const uint8_t* w, int64_t stride, int64_t blocks, const QuantRow* rows, const float* bias,
                              float* const* out, int valid) {
  constexpr bool kSuper = kType == kQ4_K || kType == kQ6_K;  // super-blocks of 8 blocks of 32
  constexpr int64_t kBytes = packed_bytes(kType);
  constexpr int64_t kScales = scale_bytes(kType);
  // Q6_K sums a block's two halves of K (its two sub-blocks of 16) apart: isum for K 0-15, isum_b for 16-31.
  constexpr int kSums = kType == kQ6_K ? 2 : 1;
  __m256 acc[H][R];
  #pragma GCC unroll 8
  for (int h = 0; h < H; ++h) {
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  }
  const __m256i low = _mm256_set1_epi8(0x0F);
  constexpr int64_t kPerBlock = kSuper ? kBytes / 8 : kBytes;  // bytes of a group a block of 32 K reads
  for (int64_t b = 0; b < blocks; ++b) {
    #pragma GCC unroll 8
    for (int h = 0; h < H; h += 2) prefetch_ahead(w + (h / 2) * stride + b * kPerBlock, kPerBlock);  // a group's two halves
    // Where block b's parts start in group 0: its packed block (the super-block for K-quants) and quants.
    const int64_t at = kSuper ? (b / 8) * kBytes : b * kBytes;
    const int64_t quants = kType == kQ4_K ? at + kQ4KQuants + 256 * (b % 8)
                           : kType == kQ6_K ? at + kQ6KQuants + kQ6KBlock * (b % 8) : at + kScales;
    __m256i isum[kSums][H][R];
    #pragma GCC unroll 8
    for (int s = 0; s < kSums; ++s) {
      #pragma GCC unroll 8
      for (int h = 0; h < H; ++h) {
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) isum[s][h][r] = _mm256_setzero_si256();
      }
    }
    if (kType == kQ8_0) {
      #pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        __m256i wv[H];
        #pragma GCC unroll 8
        for (int h = 0; h < H; ++h) wv[h] = quant_half(w + (h / 2) * stride + quants, h, 64 * c);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, rows[r].q + 32 * b + 4 * c, 4);
          const __m256i xv = _mm256_set1_epi32(x4);
          #pragma GCC unroll 8
          for (int h = 0; h < H; ++h) isum[0][h][r] = _mm256_dpbusd_avx_epi32(isum[0][h][r], wv[h], xv);
        }
      }
    } else {
      __m256i top[H], top_b[H];  // Q5_0's fifth bits; Q6_K's top two bits (K 0-15, K 16-31)
      #pragma GCC unroll 8
      for (int h = 0; h < H; ++h) {
        if (kType == kQ5_0 || kType == kQ6_K) top[h] = quant_half(w + (h / 2) * stride + quants, h, 256);
        if (kType == kQ6_K) top_b[h] = quant_half(w + (h / 2) * stride + quants, h, 320);
      }
      #pragma GCC unroll 8
      for (int c = 0; c < 4; ++c) {
        __m256i lo[H], hi[H];
        #pragma GCC unroll 8
        for (int h = 0; h < H; ++h) {
          const __m256i v = quant_half(w + (h / 2) * stride + quants, h, 64 * c);
          lo[h] = _mm256_and_si256(v, low);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          // The bits above the nibble into bit 4 (Q5_0) or bits 4-5 (Q6_K). Shifts are of 16-bit
          // lanes: the bits they carry across a byte's edge land outside the mask.
          if (kType == kQ5_0) {
            const __m256i five = _mm256_set1_epi8(0x10);
            lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(_mm256_slli_epi16(top[h], 4 - c), five));
            hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(_mm256_srli_epi16(top[h], c), five));
          }
          if (kType == kQ6_K) {
            const __m256i six = _mm256_set1_epi8(0x30);
            const __m256i a = c < 3 ? _mm256_slli_epi16(top[h], 4 - 2 * c) : _mm256_srli_epi16(top[h], 2);
            const __m256i bb = c < 3 ? _mm256_slli_epi16(top_b[h], 4 - 2 * c) : _mm256_srli_epi16(top_b[h], 2);
            lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(a, six));
            hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(bb, six));
          }
        }
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t xl, xh;
          std::memcpy(&xl, rows[r].q + 32 * b + 4 * c, 4);
          std::memcpy(&xh, rows[r].q + 32 * b + 16 + 4 * c, 4);
          const __m256i vl = _mm256_set1_epi32(xl), vh = _mm256_set1_epi32(xh);
          #pragma GCC unroll 8
          for (int h = 0; h < H; ++h) {
            isum[0][h][r] = _mm256_dpbusd_avx_epi32(isum[0][h][r], lo[h], vl);
            isum[kSums - 1][h][r] = _mm256_dpbusd_avx_epi32(isum[kSums - 1][h][r], hi[h], vh);
          }
        }
      }
    }
    #pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      const uint8_t* block = w + (h / 2) * stride + at;
      __m256 dw = halfs(block + 16 * (h % 2));
      __m256 mw = _mm256_setzero_ps();
      if (kType == kQ4_1) mw = halfs(block + 32 + 16 * (h % 2));
      if (kType == kQ4_K) {
        // dw = d * sc[j], mw = dmin * m[j]: one rounding each (the integers are exact in float32).
        mw = mul(halfs(block + 32 + 16 * (h % 2)), bytes_to_floats<false>(block + kQ4KMins + kGroup * (b % 8) + 8 * (h % 2)));
        dw = mul(dw, bytes_to_floats<false>(block + kQ4KScales + kGroup * (b % 8) + 8 * (h % 2)));
      }
      __m256 scale_a = _mm256_setzero_ps(), scale_b = _mm256_setzero_ps();
      if (kType == kQ6_K) {
        const uint8_t* scales = block + kQ6KScales + 2 * kGroup * (b % 8) + 8 * (h % 2);
        scale_a = bytes_to_floats<true>(scales);
        scale_b = bytes_to_floats<true>(scales + kGroup);
      }
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256i dot = isum[0][h][r];
        // Unsigned weights back to their signed values: Q4_0 nibble - 8, Q5_0 - 16, Q8_0 byte - 128,
        // Q6_K - 32 (exact).
        if (kType == kQ4_0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * rows[r].sum[b]));
        if (kType == kQ5_0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(16 * rows[r].sum[b]));
        if (kType == kQ8_0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(128 * rows[r].sum[b]));
        __m256 products;
        if (kType == kQ6_K) {
          // sa * isum_a + sb * isum_b: integers below 2^24 at every step, so exact however it rounds.
          const int32_t half = rows[r].half[b];
          const __m256i a = _mm256_sub_epi32(dot, _mm256_set1_epi32(32 * half));
          const __m256i bsum =
              _mm256_sub_epi32(isum[kSums - 1][h][r], _mm256_set1_epi32(32 * (rows[r].sum[b] - half)));
          products = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bsum), scale_b, _mm256_mul_ps(_mm256_cvtepi32_ps(a), scale_a));
        } else {
          products = _mm256_cvtepi32_ps(dot);
        }
        const __m256 scale = mul(dw, _mm256_set1_ps(rows[r].dx[b]));
        __m256 term = mul(scale, products);
        if (kType == kQ4_1) term = _mm256_add_ps(term, mul(mw, _mm256_set1_ps(rows[r].sx[b])));
        if (kType == kQ4_K) term = _mm256_sub_ps(term, mul(mw, _mm256_set1_ps(rows[r].sx[b])));
        acc[h][r] = _mm256_add_ps(acc[h][r], term);
      }
    }
  }
  #pragma GCC unroll 8
  for (int h = 0; h < H; ++h) {
    const int lanes = std::min(valid - 8 * h, 8);
    if (lanes <= 0) break;
    const __m256i mask = first_lanes(lanes);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256 y = acc[h][r];
      if (bias != nullptr) y = _mm256_add_ps(y, _mm256_maskload_ps(bias + 8 * h, mask));
      if (lanes == 8) {
        _mm256_storeu_ps(out[r] + 8 * h, y);
      } else {
        _mm256_maskstore_ps(out[r] + 8 * h, mask, y);
      }
    }
  }
}

// Rows of a tile: up to 4, each weight vector read once for them. (A tile's 8 int32 sums and 8
// float32 sums outgrow AVX2's 16 registers already: 2 rows fall behind, 8 more so.)
constexpr int64_t kTileRows = 4;

template <int64_t kType, int H>
KVS_AVX_VNNI_TARGET void rows_of(const uint8_t* w, int64_t stride, int64_t blocks, const QuantRow* rows, int64_t m,
                                 const float* bias, float* y, int64_t n, int64_t n0) {
  const int valid = static_cast<int>(std::min<int64_t>(8 * H, n - n0));
  for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
    float* out[kTileRows];
    for (int r = 0; r < kTileRows; ++r) out[r] = y + (m0 + r) * n + n0;
    const float* b = bias != nullptr ? bias + n0 : nullptr;
    switch (std::min<int64_t>(kTileRows, m - m0)) {
      case 4: tile<kType, H, 4>(w, stride, blocks, rows + m0, b, out, valid); break;
      case 3: tile<kType, H, 3>(w, stride, blocks, rows + m0, b, out, valid); break;
      case 2: tile<kType, H, 2>(w, stride, blocks, rows + m0, b, out, valid); break;
      default: tile<kType, H, 1>(w, stride, blocks, rows + m0, b, out, valid); break;
    }
  }
}

// Threads split the groups, one group at a time: its blocks are one stream. Pairs of groups
// (two streams, a group's bytes apart) kept more loads in flight but streamed slower from memory:
// a Zen 5 EPYC, 1 thread, 2026-12-05, the 1B-class's 22 Q4_0 layers at 1 / 2 / 3 rows 24.7 / 26.8
// / 21.5-22.9 ms a pass in pairs against 15.4 / 14.2 / 19.0-19.4 one group at a time, SmolLM2's
// 1.86 / 2.17 / 2.48 against 1.79 / 1.88 / 2.40.
template <int64_t kType>
void gemm_type(const uint8_t* packed, int64_t groups, int64_t blocks, const QuantRow* rows, int64_t m,
               const float* bias, float* y, int64_t n) {
  const int64_t stride = blocks / (block_values(kType) / kBlockK) * packed_bytes(kType);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      rows_of<kType, 2>(packed + g * stride, stride, blocks, rows, m, bias, y, n, g * kGroup);
    }
  });
}

}  // namespace

bool avx_vnni_cpu() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni") &&
                          __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  return has;
}

void avx_vnni_quantize_row(const float* x, int64_t blocks, QuantRow out) { quantize_row(x, blocks, out); }

void avx_vnni_gemm(int64_t type, const uint8_t* packed, int64_t groups, int64_t blocks, const QuantRow* rows,
                   int64_t m, const float* bias, float* y, int64_t n) {
  if (type == kQ4_0) gemm_type<kQ4_0>(packed, groups, blocks, rows, m, bias, y, n);
  if (type == kQ4_1) gemm_type<kQ4_1>(packed, groups, blocks, rows, m, bias, y, n);
  if (type == kQ8_0) gemm_type<kQ8_0>(packed, groups, blocks, rows, m, bias, y, n);
  if (type == kQ5_0) gemm_type<kQ5_0>(packed, groups, blocks, rows, m, bias, y, n);
  if (type == kQ4_K) gemm_type<kQ4_K>(packed, groups, blocks, rows, m, bias, y, n);
  if (type == kQ6_K) gemm_type<kQ6_K>(packed, groups, blocks, rows, m, bias, y, n);
}
#else
bool avx_vnni_cpu() { return false; }
void avx_vnni_quantize_row(const float*, int64_t, QuantRow) {}
void avx_vnni_gemm(int64_t, const uint8_t*, int64_t, int64_t, const QuantRow*, int64_t, const float*, float*,
                   int64_t) {}
#endif

}  // namespace kvsentry_int8
