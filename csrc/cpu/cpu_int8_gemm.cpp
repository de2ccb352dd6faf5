// The int8-activation GEMM of GGUF blocks (AVX512-VNNI): y = x W^T with x quantized per block of
// 32 values to int8 (a float32 scale per block, and its sum for Q4_1's and Q4_K's minima), multiplied
// with `vpdpbusd` against the weight's own Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K blocks. The
// arithmetic, and the order of every float32 rounding, is engine/models/int8_reference.py's
// (tests/csrc/test_int8_gemm.py holds them to the same bits); each output is summed over K's
// blocks in order, the same way whatever batch its row is in.
//
//   packed = torch.ops.kvsentry.int8_gemm_pack(raw, type, k)
//            raw [N, K / values * block bytes] uint8: a GGUF tensor's rows of Q4_0 (type 2),
//            Q4_1 (3), Q5_0 (6), Q8_0 (8) (blocks of 32 values), Q4_K (12) or Q6_K (14) (super-blocks
//            of 256) -> [ceil(N / 16), K / values, block bytes'] uint8
//   y = torch.ops.kvsentry.int8_gemm(x [M, K] float32 or bf16, packed, bias [N] or None, N) -> [M, N]
//   torch.ops.kvsentry.int8_gemm_supported() -> bool  a vector kernel runs here: AVX512-VNNI (built
//            with AVX-512 and the CPU has it), or else AVX-VNNI (cpu_int8_gemm_avx.cpp: the same
//            packed blocks, the same bits, in 256-bit halves of a group)
//   torch.ops.kvsentry_debug.int8_gemm_isa(str? isa) -> str   the test build's switch: run the
//            "avx512_vnni" or "avx_vnni" kernel (one this CPU has), or "auto"; returns the one that runs
//   y = torch.ops.kvsentry.int8_gemm_parts(x, parts, bias [N] or None, N) -> [M, N]: a linear whose
//            outputs come in parts of different types (a q|k|v whose v is another format), each
//            int8_gemm's: parts uint8 [bytes], a header of int64 (the count P, then per part its
//            N_p and its packed shape [groups, blocks, block bytes']) zero-padded to a multiple of
//            64 bytes, then each part's packed blocks in order (engine/models/int8_linear.py).
//
// Packed layout: one block per 32 of K for a group of 16 outputs: the 16 scales as float16
// (Q4_1: then the 16 minima), then the quants as 64-byte vectors whose byte 4r + j belongs to
// output r: Q4_0 / Q4_1 4 vectors, vector c holding the GGUF byte 4c + j of output r (its low
// nibble K = 4c + j, its high nibble K = 16 + 4c + j); Q8_0 8 vectors, vector c the int8 at
// K = 4c + j plus 128 (vpdpbusd multiplies unsigned by signed bytes). The same bytes per weight
// as the file (the group's padding outputs aside): 0.5625 (Q4_0), 0.625 (Q4_1), 1.0625 (Q8_0).
// Q5_0 adds a fifth vector of the values' fifth bits (byte 4r + j: bit c that of K = 4c + j, bit
// 4 + c that of K = 16 + 4c + j), 0.6875 bytes per weight as the file. The K-quants pack a
// super-block of 256 K: Q4_K the 16 d, then the 16 dmin (float16), the 8 sub-blocks' 6-bit scales
// (byte 16 j + r: sub-block j, output r), their 8 minima, then each sub-block's 32 K as Q4_1's 4
// vectors: 2368 bytes for 4096 weights, 0.578 per weight (the file's 0.5625). Q6_K: the 16 d, the
// 16 sub-blocks of 16's int8 scales (byte 16 s + r), then per 32 K the low 4 bits as Q4_0's 4
// vectors and the top 2 bits as two more (byte 4r + j: bits 2c, 2c + 1 those of K = 4c + j in the
// first, of K = 16 + 4c + j in the second): 3360 bytes, 0.8203 per weight, as the file.
// One vpdpbusd then adds 4 products for 16 outputs; a tile of 2 groups x 4 batch rows reuses
// each weight vector 4 times and each activation broadcast twice; decode batches take one group
// x up to 8 rows instead (one_group_tiles: one stream of blocks), as do batches up to 32 rows of
// the large groups of K up to 2048.
// On CPUs with AMX-INT8, batches of Q4_0 / Q4_1 / Q8_0 from a few rows up take the same blocks
// on tiles instead (cpu_int8_gemm_amx.cpp), to the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_amx.h"
#include "cpu_int8_gemm.h"
#include "cpu_reduce16.h"
#include "cpu_int8_gemm_amx.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using at::Tensor;
using namespace kvsentry_int8::layout;
using kvsentry_int8::QuantRow;
using kvsentry_int8::prefetch_ahead;
using kvsentry_int8::VectorIsa;
constexpr const char* kOp = "kvsentry::int8_gemm";
int64_t gguf_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ6_K: return 210;
    default: return 0;
  }
}
int64_t type_of(int64_t bytes) {
  for (int64_t type : {kQ4_0, kQ4_1, kQ5_0, kQ8_0, kQ4_K, kQ6_K}) {
    if (packed_bytes(type) == bytes) return type;
  }
  return -1;
}

// 32 values' low 4 bits (v[0-31]) into output r of 4 nibble vectors at q: vector c's byte
// 4r + j holds K = 4c + j in its low nibble, K = 16 + 4c + j in its high one.
void place_nibbles(const uint8_t* v, int64_t r, uint8_t* q) {
  for (int64_t k = 0; k < 16; ++k) {
    q[(k / 4) * 64 + 4 * r + k % 4] = static_cast<uint8_t>((v[k] & 0x0F) | ((v[16 + k] & 0x0F) << 4));
  }
}

// 32 values' bits above the low 4, `width` of them (Q5_0: 1, Q6_K: 2), into output r of the
// vectors at h: for width 1 one vector (byte 4r + j: bit c from K = 4c + j, bit 4 + c from
// K = 16 + 4c + j); for width 2 two (bits 2c, 2c + 1: K = 4c + j, then K = 16 + 4c + j).
void place_high_bits(const uint8_t* v, int64_t r, int width, uint8_t* h) {
  for (int64_t c = 0; c < 4; ++c) {
    for (int64_t j = 0; j < 4; ++j) {
      const int lo = v[4 * c + j] >> 4, hi = v[16 + 4 * c + j] >> 4;
      if (width == 1) {
        h[4 * r + j] |= static_cast<uint8_t>((lo << c) | (hi << (4 + c)));
      } else {
        h[4 * r + j] |= static_cast<uint8_t>(lo << (2 * c));
        h[64 + 4 * r + j] |= static_cast<uint8_t>(hi << (2 * c));
      }
    }
  }
}

// A Q4_K super-block's 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4).
void q4_k_scale_min(int64_t j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// A Q4_K super-block into output r of a packed one.
void place_q4_k(const uint8_t* src, int64_t r, uint8_t* dst) {
  std::memcpy(dst + 2 * r, src, 2);                // d
  std::memcpy(dst + 2 * kGroup + 2 * r, src + 2, 2);  // dmin
  for (int64_t j = 0; j < 8; ++j) {
    q4_k_scale_min(j, src + 4, dst + kQ4KScales + kGroup * j + r, dst + kQ4KMins + kGroup * j + r);
    // Sub-block j: the low (j even) or high nibbles of the 32 bytes 32 (j / 2) onwards.
    uint8_t v[32];
    for (int64_t i = 0; i < 32; ++i) v[i] = static_cast<uint8_t>((src[16 + 32 * (j / 2) + i] >> (4 * (j % 2))) & 0x0F);
    place_nibbles(v, r, dst + kQ4KQuants + 256 * j);
  }
}

// A Q6_K super-block into output r of a packed one: its values 0-63 (ggml's dequantize_row_q6_K
// before the - 32) as 4 low bits and 2 high ones.
void place_q6_k(const uint8_t* src, int64_t r, uint8_t* dst) {
  const uint8_t *ql = src, *qh = src + 128;
  std::memcpy(dst + 2 * r, src + 208, 2);  // d
  for (int64_t s = 0; s < 16; ++s) dst[kQ6KScales + kGroup * s + r] = src[192 + s];
  uint8_t v[256];
  for (int64_t n = 0; n < 2; ++n) {
    for (int64_t l = 0; l < 32; ++l) {
      const uint8_t a = ql[64 * n + l], b = ql[64 * n + 32 + l], h = qh[32 * n + l];
      v[128 * n + l] = static_cast<uint8_t>((a & 0x0F) | ((h & 3) << 4));
      v[128 * n + 32 + l] = static_cast<uint8_t>((b & 0x0F) | (((h >> 2) & 3) << 4));
      v[128 * n + 64 + l] = static_cast<uint8_t>((a >> 4) | (((h >> 4) & 3) << 4));
      v[128 * n + 96 + l] = static_cast<uint8_t>((b >> 4) | (((h >> 6) & 3) << 4));
    }
  }
  for (int64_t j = 0; j < 8; ++j) {
    uint8_t* block = dst + kQ6KQuants + kQ6KBlock * j;
    place_nibbles(v + 32 * j, r, block);
    place_high_bits(v + 32 * j, r, 2, block + 256);
  }
}

// One GGUF block (a row's 32 K) into output r of a packed block.
void place(const uint8_t* src, int64_t type, int64_t r, uint8_t* dst) {
  if (type == kQ4_K) return place_q4_k(src, r, dst);
  if (type == kQ6_K) return place_q6_k(src, r, dst);
  std::memcpy(dst + 2 * r, src, 2);  // the scale
  if (type == kQ4_1) std::memcpy(dst + 2 * kGroup + 2 * r, src + 2, 2);  // the minimum
  uint8_t* q = dst + scale_bytes(type);
  const uint8_t* qs = src + (type == kQ4_1 ? 4 : 2);
  if (type == kQ8_0) {
    for (int64_t k = 0; k < kBlockK; ++k) q[(k / 4) * 64 + 4 * r + k % 4] = static_cast<uint8_t>(qs[k] ^ 0x80);
  } else if (type == kQ5_0) {
    // qh (little-endian: bit k is K's fifth bit), then the nibbles as Q4_0's.
    uint32_t qh;
    std::memcpy(&qh, src + 2, 4);
    uint8_t v[32];
    for (int64_t k = 0; k < 16; ++k) {
      v[k] = static_cast<uint8_t>((src[6 + k] & 0x0F) | (((qh >> k) & 1) << 4));
      v[16 + k] = static_cast<uint8_t>((src[6 + k] >> 4) | (((qh >> (16 + k)) & 1) << 4));
    }
    place_nibbles(v, r, q);
    place_high_bits(v, r, 1, q + 256);
  } else {
    for (int64_t k = 0; k < 16; ++k) q[(k / 4) * 64 + 4 * r + k % 4] = qs[k];
  }
}

Tensor pack(const Tensor& raw_in, int64_t type, int64_t k) {
  const int64_t bytes = gguf_bytes(type);
  TORCH_CHECK(bytes > 0, kOp, "_pack: GGML type ", type,
              " is not Q4_0 (2), Q4_1 (3), Q5_0 (6), Q8_0 (8), Q4_K (12) or Q6_K (14)");
  const int64_t values = block_values(type);
  TORCH_CHECK(k > 0 && k % values == 0, kOp, "_pack: K = ", k, " is not whole blocks of ", values);
  const int64_t blocks = k / values;
  TORCH_CHECK(raw_in.dim() == 2 && raw_in.scalar_type() == at::kByte && raw_in.device().is_cpu() &&
                  raw_in.size(1) == blocks * bytes,
              kOp, "_pack: raw must be CPU uint8 [N, ", blocks * bytes, "], got ", raw_in.sizes());
  const Tensor raw = raw_in.contiguous();
  const int64_t n = raw.size(0), groups = (n + kGroup - 1) / kGroup, out_bytes = packed_bytes(type);
  // Padding outputs: scale 0 (and quants 0), so they add exact zeros and are never stored.
  Tensor packed = at::zeros({groups, blocks, out_bytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t r = 0; r < kGroup && g * kGroup + r < n; ++r) {
        const uint8_t* row = src + (g * kGroup + r) * blocks * bytes;
        for (int64_t b = 0; b < blocks; ++b) place(row + b * bytes, type, r, dst + (g * blocks + b) * out_bytes);
      }
    }
  });
  return packed;
}

#if defined(__AVX512F__)
#define KVS_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// 32 values of block b as two float32 vectors: float32 as they are, bf16 widened (exact).
KVS_INT8_TARGET inline void load_block(const float* x, int64_t b, __m512& lo, __m512& hi) {
  lo = _mm512_loadu_ps(x + 32 * b);
  hi = _mm512_loadu_ps(x + 32 * b + 16);
}

KVS_INT8_TARGET inline void load_block(const c10::BFloat16* x, int64_t b, __m512& lo, __m512& hi) {
  const auto widen = [](const c10::BFloat16* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  lo = widen(x + 32 * b);
  hi = widen(x + 32 * b + 16);
}

// Blocks of 32 values to int8, the reference's arithmetic: dx = amax / 127, q = round(x / dx)
// (x * (1 / dx), nearest even), the block's quant sum and its first half's, sx = dx * sum. Sixteen
// blocks at a time: their maxima and sums reduced together (cpu_reduce16.h), the divisions as vectors
// (each lane the same IEEE division as a scalar's). Maxima and integer sums are exact in any order.
template <typename scalar_t>
KVS_INT8_TARGET void quantize_row(const scalar_t* x, int64_t blocks, QuantRow out) {
  const __m512 zero = _mm512_setzero_ps(), limit = _mm512_set1_ps(127.0f);
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, blocks - b0));
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    __m512 vmax[16];
    for (int i = 0; i < 16; ++i) {
      if (i < n) {
        __m512 lo, hi;
        load_block(x, b0 + i, lo, hi);
        vmax[i] = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
      } else {
        vmax[i] = _mm512_setzero_ps();
      }
    }
    const __m512 amax = kvsentry_simd::reduce16(vmax, kvsentry_simd::MaxPs{});
    const __m512 dx = _mm512_div_ps(amax, limit);  // a division, as torch's
    const __m512 inverse = _mm512_mask_div_ps(zero, _mm512_cmp_ps_mask(dx, zero, _CMP_NEQ_UQ), _mm512_set1_ps(1.0f), dx);
    alignas(64) float inv[16];
    _mm512_store_ps(inv, inverse);
    __m512 vsum[16], vhalf[16];  // int32 lanes
    for (int i = 0; i < 16; ++i) {
      if (i < n) {
        __m512 lo, hi;
        load_block(x, b0 + i, lo, hi);
        const __m512 scale = _mm512_set1_ps(inv[i]);
        // Rounded to nearest even (MXCSR's default), as torch.round.
        const __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(lo, scale, kRound), kRound);
        const __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(hi, scale, kRound), kRound);
        int8_t* q = out.q + 32 * (b0 + i);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
        vsum[i] = _mm512_castsi512_ps(_mm512_add_epi32(qlo, qhi));
        vhalf[i] = _mm512_castsi512_ps(qlo);
      } else {
        vsum[i] = vhalf[i] = _mm512_setzero_ps();
      }
    }
    const __m512i sum = _mm512_castps_si512(kvsentry_simd::reduce16(vsum, kvsentry_simd::AddEpi32{}));
    _mm512_mask_storeu_ps(out.dx + b0, live, dx);
    _mm512_mask_storeu_epi32(out.sum + b0, live, sum);
    _mm512_mask_storeu_epi32(out.half + b0, live, _mm512_castps_si512(kvsentry_simd::reduce16(vhalf, kvsentry_simd::AddEpi32{})));
    _mm512_mask_storeu_ps(out.sx + b0, live, _mm512_mul_ps(dx, _mm512_cvtepi32_ps(sum)));
  }
}


// store_bf16_as_torch on 16 lanes: round to nearest even, any NaN to 0xFFFF.
KVS_INT8_TARGET inline __m256i bf16_as_torch(__m512 y) {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
  return _mm512_cvtepi32_epi16(rounded);
}

// Outputs of G groups (from `w`, `stride` bytes apart) for R batch rows: y[r][16 g + lane],
// float32 into out[r], or rounded to bf16 into out16[r] where out16 is given: the tile's
// outputs leave as bf16 from registers, not through a float32 matrix read back after.
// The *_round_ps intrinsics keep every product and sum its own rounding (no contraction to FMA).
template <int64_t kType, int G, int R>
KVS_INT8_TARGET void tile(const uint8_t* w, int64_t stride, int64_t blocks, const QuantRow* rows, const float* bias,
                          float* const* out, c10::BFloat16* const* out16, int valid) {
  constexpr bool kSuper = kType == kQ4_K || kType == kQ6_K;  // super-blocks of 8 blocks of 32
  constexpr int64_t kBytes = kType == kQ4_K ? kQ4KBytes : kType == kQ6_K ? kQ6KBytes
                             : kType == kQ4_1 ? 320 : kType == kQ4_0 ? 288 : kType == kQ5_0 ? 352 : 544;
  constexpr int64_t kScales = kType == kQ4_1 ? 64 : 32;
  // Q6_K sums a block's two halves (its two sub-blocks of 16) apart: isum for K 0-15, isum_b for 16-31.
  constexpr int kHalves = kType == kQ6_K ? 2 : 1;
  __m512 acc[G][R];
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  constexpr int64_t kPerBlock = kSuper ? kBytes / 8 : kBytes;  // bytes of a group a block of 32 K reads
  for (int64_t b = 0; b < blocks; ++b) {
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g) prefetch_ahead(w + g * stride + b * kPerBlock, kPerBlock);
    // Where block b's parts start in group 0: its packed block (the super-block for K-quants) and quants.
    const int64_t at = kSuper ? (b / 8) * kBytes : b * kBytes;
    const int64_t quants = kType == kQ4_K ? at + kQ4KQuants + 256 * (b % 8)
                           : kType == kQ6_K ? at + kQ6KQuants + kQ6KBlock * (b % 8) : at + kScales;
    // Unsigned weights back to their signed values (Q4_0 nibble - 8, Q5_0 - 16, Q8_0 byte - 128):
    // each row's sums start at -offset * (its block's quant sum) instead of 0, one instruction
    // fewer per output vector than subtracting it after (integers: the same sums exactly).
    constexpr int32_t kOffset = kType == kQ4_0 ? 8 : kType == kQ5_0 ? 16 : kType == kQ8_0 ? 128 : 0;
    __m512i start[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      start[r] = kOffset != 0 ? _mm512_set1_epi32(-kOffset * rows[r].sum[b]) : _mm512_setzero_si512();
    }
    __m512i isum[kHalves][G][R];
    #pragma GCC unroll 8
    for (int h = 0; h < kHalves; ++h) {
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) isum[h][g][r] = h == 0 ? start[r] : _mm512_setzero_si512();
      }
    }
    if (kType == kQ8_0) {
      #pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        __m512i wv[G];
        #pragma GCC unroll 8
        for (int g = 0; g < G; ++g) wv[g] = _mm512_loadu_si512(w + g * stride + quants + 64 * c);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, rows[r].q + 32 * b + 4 * c, 4);
          const __m512i xv = _mm512_set1_epi32(x4);
          #pragma GCC unroll 8
          for (int g = 0; g < G; ++g) isum[0][g][r] = _mm512_dpbusd_epi32(isum[0][g][r], wv[g], xv);
        }
      }
    } else {
      __m512i top[G], top_b[G];  // Q5_0's fifth bits; Q6_K's top two bits (K 0-15, K 16-31)
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        if (kType == kQ5_0 || kType == kQ6_K) top[g] = _mm512_loadu_si512(w + g * stride + quants + 256);
        if (kType == kQ6_K) top_b[g] = _mm512_loadu_si512(w + g * stride + quants + 320);
      }
      #pragma GCC unroll 8
      for (int c = 0; c < 4; ++c) {
        __m512i lo[G], hi[G];
        #pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const __m512i v = _mm512_loadu_si512(w + g * stride + quants + 64 * c);
          lo[g] = _mm512_and_si512(v, low);
          hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          // The bits above the nibble into bit 4 (Q5_0) or bits 4-5 (Q6_K). Shifts are of 16-bit
          // lanes: the bits they carry across a byte's edge land outside the mask.
          if (kType == kQ5_0) {
            const __m512i five = _mm512_set1_epi8(0x10);
            lo[g] = _mm512_or_si512(lo[g], _mm512_and_si512(_mm512_slli_epi16(top[g], 4 - c), five));
            hi[g] = _mm512_or_si512(hi[g], _mm512_and_si512(_mm512_srli_epi16(top[g], c), five));
          }
          if (kType == kQ6_K) {
            const __m512i six = _mm512_set1_epi8(0x30);
            const __m512i a = c < 3 ? _mm512_slli_epi16(top[g], 4 - 2 * c) : _mm512_srli_epi16(top[g], 2);
            const __m512i bb = c < 3 ? _mm512_slli_epi16(top_b[g], 4 - 2 * c) : _mm512_srli_epi16(top_b[g], 2);
            lo[g] = _mm512_or_si512(lo[g], _mm512_and_si512(a, six));
            hi[g] = _mm512_or_si512(hi[g], _mm512_and_si512(bb, six));
          }
        }
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t xl, xh;
          std::memcpy(&xl, rows[r].q + 32 * b + 4 * c, 4);
          std::memcpy(&xh, rows[r].q + 32 * b + 16 + 4 * c, 4);
          const __m512i vl = _mm512_set1_epi32(xl), vh = _mm512_set1_epi32(xh);
          #pragma GCC unroll 8
          for (int g = 0; g < G; ++g) {
            isum[0][g][r] = _mm512_dpbusd_epi32(isum[0][g][r], lo[g], vl);
            isum[kHalves - 1][g][r] = _mm512_dpbusd_epi32(isum[kHalves - 1][g][r], hi[g], vh);
          }
        }
      }
    }
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const uint8_t* block = w + g * stride + at;
      __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
      __m512 mw = _mm512_setzero_ps();
      if (kType == kQ4_1) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
      if (kType == kQ4_K) {
        // dw = d * sc[j], mw = dmin * m[j]: one rounding each (the integers are exact in float32).
        const auto six_bits = [&](int64_t offset) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + offset));
          return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
        };
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
        dw = _mm512_mul_round_ps(dw, six_bits(kQ4KScales + kGroup * (b % 8)), kRound);
        mw = _mm512_mul_round_ps(dmin, six_bits(kQ4KMins + kGroup * (b % 8)), kRound);
      }
      __m512 scale_a = _mm512_setzero_ps(), scale_b = _mm512_setzero_ps();
      if (kType == kQ6_K) {
        const uint8_t* scales = block + kQ6KScales + 2 * kGroup * (b % 8);
        scale_a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales))));
        scale_b = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + kGroup))));
      }
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i dot = isum[0][g][r];  // Q6_K's - 32 below (exact)
        __m512 products;
        if (kType == kQ6_K) {
          // sa * isum_a + sb * isum_b: integers below 2^24 at every step, so float32 holds each
          // exactly (a fused multiply-add too) and it is the reference's integer.
          const int32_t half = rows[r].half[b];
          const __m512i a = _mm512_sub_epi32(dot, _mm512_set1_epi32(32 * half));
          const __m512i bsum =
              _mm512_sub_epi32(isum[kHalves - 1][g][r], _mm512_set1_epi32(32 * (rows[r].sum[b] - half)));
          products = _mm512_fmadd_ps(_mm512_cvtepi32_ps(bsum), scale_b, _mm512_mul_ps(_mm512_cvtepi32_ps(a), scale_a));
        } else {
          products = _mm512_cvtepi32_ps(dot);
        }
        const __m512 scale = _mm512_mul_round_ps(dw, _mm512_set1_ps(rows[r].dx[b]), kRound);
        __m512 term = _mm512_mul_round_ps(scale, products, kRound);
        if (kType == kQ4_1) term = _mm512_add_round_ps(term, _mm512_mul_round_ps(mw, _mm512_set1_ps(rows[r].sx[b]), kRound), kRound);
        if (kType == kQ4_K) {
          term = _mm512_sub_round_ps(term, _mm512_mul_round_ps(mw, _mm512_set1_ps(rows[r].sx[b]), kRound), kRound);
        }
        acc[g][r] = _mm512_add_round_ps(acc[g][r], term, kRound);
      }
    }
  }
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const int lanes = std::min(valid - 16 * g, 16);
    if (lanes <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 y = acc[g][r];
      if (bias != nullptr) y = _mm512_add_round_ps(y, _mm512_maskz_loadu_ps(mask, bias + 16 * g), kRound);
      if (out16 != nullptr) {
        _mm256_mask_storeu_epi16(out16[r] + 16 * g, mask, bf16_as_torch(y));
      } else {
        _mm512_mask_storeu_ps(out[r] + 16 * g, mask, y);
      }
    }
  }
}

// A group pair's tiles take 4 rows at a time; one group's take 8 (its 16 sums fit the registers).
template <int64_t kType, int G>
KVS_INT8_TARGET void rows_of(const uint8_t* w, int64_t stride, int64_t blocks, const QuantRow* rows, int64_t m,
                             const float* bias, float* y, c10::BFloat16* y16, int64_t n, int64_t n0) {
  constexpr int kRows = G == 1 ? 8 : 4;
  const int valid = static_cast<int>(std::min<int64_t>(G * kGroup, n - n0));
  for (int64_t m0 = 0; m0 < m; m0 += kRows) {
    float* out[kRows] = {};
    c10::BFloat16* out16[kRows] = {};
    for (int r = 0; r < kRows && m0 + r < m; ++r) {
      if (y16 != nullptr) {
        out16[r] = y16 + (m0 + r) * n + n0;
      } else {
        out[r] = y + (m0 + r) * n + n0;
      }
    }
    const float* b = bias != nullptr ? bias + n0 : nullptr;
    c10::BFloat16* const* o16 = y16 != nullptr ? out16 : nullptr;
    if constexpr (G == 1) {
      switch (std::min<int64_t>(kRows, m - m0)) {
        case 8: tile<kType, G, 8>(w, stride, blocks, rows + m0, b, out, o16, valid); continue;
        case 7: tile<kType, G, 7>(w, stride, blocks, rows + m0, b, out, o16, valid); continue;
        case 6: tile<kType, G, 6>(w, stride, blocks, rows + m0, b, out, o16, valid); continue;
        case 5: tile<kType, G, 5>(w, stride, blocks, rows + m0, b, out, o16, valid); continue;
        default: break;
      }
    }
    switch (std::min<int64_t>(4, m - m0)) {
      case 4: tile<kType, G, 4>(w, stride, blocks, rows + m0, b, out, o16, valid); break;
      case 3: tile<kType, G, 3>(w, stride, blocks, rows + m0, b, out, o16, valid); break;
      case 2: tile<kType, G, 2>(w, stride, blocks, rows + m0, b, out, o16, valid); break;
      default: tile<kType, G, 1>(w, stride, blocks, rows + m0, b, out, o16, valid); break;
    }
  }
}

// Whether a batch of m rows takes its tiles one group at a time instead of in pairs of groups;
// `stride`: a group's bytes. A decode batch does few multiply-adds per weight byte and is bound
// by the weights' stream: one group at a time reads it as one sequential stream, where a pair
// reads two, a group's bytes apart. A Zen 5 EPYC, 1 thread (2026-12-05), ms a pass over the
// layers' blocks at 1 / 2 / 4 / 8 rows, pairs against one group: the 1B-class's 22 Q4_0 layers
// (545 MB) 19.1 / 24.1 / 31.1 / 40.2 against 14.9 / 15.7 / 14.5 / 25.5, its Q8_0 LM head 3.5 /
// 3.7 / 4.2 / 5.4 against 2.8 / 3.0 / 3.7 / 3.4. Short groups (below 8 KiB: SmolLM2's Q4_0 rows of
// 576, 5 KiB) lie close enough together for a pair to gain from its shared activations from 4
// rows (its q|k|v at 6 / 8 rows 12.4 / 15.7 us against 13.7 / 17.5), and every group does from 9
// rows (SmolLM2's layers at 64 rows: 19.2 ms against 23.3).
// Groups of 16 KiB or more with K at most 2048 (the 1B-class's q|k|v, o and gate|up, its Q8_0 LM
// head) keep one group up to 32 rows: a pair's tiles of 4 rows read the pair's blocks (36 KiB and
// more, past a 48 KiB L1 beside the rows) once per 4 rows, one group's tiles of 8 once per 8.
// The same Zen 5, us a call from memory at 12 / 16 / 24 / 32 rows, pairs against one group: Q4_0
// 2048 x 2048 235 / 282 / 369 / 458 against 174 / 224 / 338 / 447, the Q8_0 49152 x 2048 head
// 6316 / 7608 / 9882 / 12269 against 4619 / 5726 / 8472 / 11139 (at 48 rows 634 against 675 and
// 17022 against 16517). With K = 5632 (the 1B-class's down projection) 8 rows' activations fill
// the L1 instead, and pairs win from 16 rows (626 / 878 / 1112 against 642 / 940 / 1248).
bool one_group_tiles(int64_t m, int64_t stride, int64_t blocks) {
  return m <= 2 || (m <= 8 && stride >= 8192) || (m <= 32 && stride >= 16384 && blocks <= 64);
}

template <int64_t kType>
void gemm_type(const uint8_t* packed, int64_t groups, int64_t blocks, const QuantRow* rows, int64_t m,
               const float* bias, float* y, c10::BFloat16* y16, int64_t n) {
  const int64_t stride = blocks / (block_values(kType) / kBlockK) * packed_bytes(kType);
  if (one_group_tiles(m, stride, blocks)) {
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        rows_of<kType, 1>(packed + g * stride, stride, blocks, rows, m, bias, y, y16, n, g * kGroup);
      }
    });
    return;
  }
  const int64_t pairs = (groups + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* w = packed + 2 * p * stride;
      if (2 * p + 1 < groups) {
        rows_of<kType, 2>(w, stride, blocks, rows, m, bias, y, y16, n, 2 * p * kGroup);
      } else {
        rows_of<kType, 1>(w, stride, blocks, rows, m, bias, y, y16, n, 2 * p * kGroup);
      }
    }
  });
}
#endif

// The 512-bit kernel where the CPU (and build) has AVX512-VNNI, else the 256-bit one where it has
// AVX-VNNI (cpu_int8_gemm_avx.cpp), else none (the engine runs the torch reference).
VectorIsa best_isa() {
#if defined(__AVX512F__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni")) {
    return VectorIsa::kAvx512Vnni;
  }
#endif
  return kvsentry_int8::avx_vnni_cpu() ? VectorIsa::kAvxVnni : VectorIsa::kNone;
}

#ifdef KVSENTRY_DEBUG_OPS
// The test build's choice of vector kernel (kNone: the best), so that a CPU with both runs either.
std::atomic<VectorIsa> g_forced{VectorIsa::kNone};

// kvsentry_debug.int8_gemm_isa: "avx512_vnni" or "avx_vnni" runs that kernel (this CPU and build
// must have it; AVX-VNNI alone takes no AMX tiles, as on a CPU without AVX-512), "auto" the best;
// returns the kernel that runs.
std::string choose_isa(std::optional<std::string> isa) {
  if (isa.has_value()) {
    VectorIsa chosen = VectorIsa::kNone;
    if (*isa == "avx512_vnni") chosen = VectorIsa::kAvx512Vnni;
    if (*isa == "avx_vnni") chosen = VectorIsa::kAvxVnni;
    TORCH_CHECK(chosen != VectorIsa::kNone || *isa == "auto", "int8_gemm_isa: ", *isa,
                " is not avx512_vnni, avx_vnni or auto");
    TORCH_CHECK(chosen != VectorIsa::kAvx512Vnni || best_isa() == VectorIsa::kAvx512Vnni,
                "int8_gemm_isa: this CPU (or build) has no AVX512-VNNI");
    TORCH_CHECK(chosen != VectorIsa::kAvxVnni || kvsentry_int8::avx_vnni_cpu(), "int8_gemm_isa: this CPU has no AVX-VNNI");
    g_forced.store(chosen);
  }
  return kvsentry_int8::isa_name(kvsentry_int8::vector_isa());
}

#if defined(__AVX512F__)
// The AVX512-VNNI peak of this thread, in multiply-adds per second: vpdpbusd back to back on
// register-resident operands, 16 independent accumulators (more than latency x throughput on the
// cores we know), each instruction 16 lanes x 4 byte products. The arithmetic ceiling of the
// 512-bit int8 kernel, as int8_amx_tile_peak is of the tiles.
KVS_INT8_TARGET double vnni_peak(int64_t iterations) {
  TORCH_CHECK(best_isa() == VectorIsa::kAvx512Vnni, "int8_vnni_peak: this CPU (or build) has no AVX512-VNNI");
  constexpr int kAcc = 16;
  __m512i acc[kAcc];
  #pragma GCC unroll 16
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
    #pragma GCC unroll 16
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  }
  __m512i sum = acc[0];
  #pragma GCC unroll 16
  for (int i = 1; i < kAcc; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  volatile int32_t sink = _mm512_reduce_add_epi32(sum);  // the products done before the clock stops
  (void)sink;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(iterations) * kAcc * 64 / seconds;
}
#else
double vnni_peak(int64_t) { TORCH_CHECK(false, "int8_vnni_peak: built without AVX-512"); }
#endif
#endif

bool supported() { return kvsentry_int8::vector_isa() != VectorIsa::kNone; }

// One row of x [blocks * 32] quantized by the kernel that multiplies it: the same bits either way.
void quantize([[maybe_unused]] VectorIsa isa, const float* x, int64_t blocks, QuantRow out) {
#if defined(__AVX512F__)
  if (isa == VectorIsa::kAvx512Vnni) return quantize_row(x, blocks, out);
#endif
  kvsentry_int8::avx_vnni_quantize_row(x, blocks, out);
}

// The 512-bit kernel quantizes a bf16 row as it reads it; the 256-bit one takes float32.
bool quantizes_bf16([[maybe_unused]] VectorIsa isa) {
#if defined(__AVX512F__)
  return isa == VectorIsa::kAvx512Vnni;
#else
  return false;
#endif
}

void quantize([[maybe_unused]] VectorIsa isa, const c10::BFloat16* x, int64_t blocks, QuantRow out) {
#if defined(__AVX512F__)
  quantize_row(x, blocks, out);
#endif
}

// float32 -> bfloat16 with the bits of y.to(torch.bfloat16) on CPU (ATen's vectorized
// conversion): round to nearest even, any NaN to 0xFFFF. A plain loop that the compiler
// vectorizes, so that a bf16 caller's output is rounded without a second op's dispatch, its
// float32 tensor and its copy kernel (about 1 us of a one-row linear's 2-20).
void store_bf16_as_torch(const float* src, c10::BFloat16* dst, int64_t count) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, 4);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    out[i] = (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0xFFFF} : static_cast<uint16_t>(rounded);
  }
}

// One calling thread's working memory for gemm_of, kept from call to call: a decode step makes
// ~120 calls, and their nine allocations each (quants, scales, sums, rows, the float32 outputs)
// were 5-8% of a one-row step in malloc, free and the heap's consolidation. 64-byte aligned
// pieces, carved in order; grown when a call needs more. What a long prefill or a prompt's
// logprobs needed (hundreds of MB for an LM head over thousands of rows) is not kept: past
// kKeepBytes the memory goes back after the call, as the tensors it replaced did.
class Arena {
 public:
  static constexpr size_t kKeepBytes = size_t{16} << 20;  // a 64-row decode step's LM head fits
  void trim() {
    if (capacity_ > kKeepBytes) {
      memory_.reset();
      capacity_ = 0;
    }
  }
  void reset(size_t bytes) {
    if (bytes > capacity_) {
      capacity_ = (bytes + (1u << 16) - 1) / (1u << 16) * (1u << 16);
      memory_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, capacity_)));
      TORCH_CHECK(memory_ != nullptr, kOp, ": out of memory for ", capacity_, " bytes of scratch");
    }
    used_ = 0;
  }
  template <typename T>
  T* take(size_t count) {
    T* at = reinterpret_cast<T*>(memory_.get() + used_);
    used_ += line(count * sizeof(T));
    TORCH_CHECK(used_ <= capacity_, kOp, ": scratch taken past what reset() asked for");
    return at;
  }
  static size_t line(size_t bytes) { return (bytes + 63) / 64 * 64; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> memory_;
  size_t capacity_ = 0, used_ = 0;
};

Tensor gemm_of(const Tensor& x_in, const Tensor& packed, const std::optional<Tensor>& bias_in, int64_t n) {
  TORCH_CHECK(kvsentry_int8::vector_isa() != VectorIsa::kNone, kOp,
              ": this CPU (or build) has neither AVX512-VNNI nor AVX-VNNI");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  type_of(packed.size(2)) >= 0,
              kOp, ": packed must come from int8_gemm_pack");
  // blocks: of 32 K (a K-quant's packed super-block holds 8).
  const int64_t type = type_of(packed.size(2)), groups = packed.size(0);
  const int64_t blocks = packed.size(1) * (block_values(type) / kBlockK);
  const int64_t k = blocks * kBlockK;
  const VectorIsa isa = kvsentry_int8::vector_isa();
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              kOp, ": x must be float32 or bf16 [M, ", k, "], got ", x_in.sizes(), " ", x_in.scalar_type());
  TORCH_CHECK(n > (groups - 1) * kGroup && n <= groups * kGroup, kOp, ": N = ", n, " does not fit ", groups,
              " groups of 16");
  Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == n, kOp, ": bias must be [", n, "]");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  // bf16 activations are widened as they are quantized (exact): in registers by the 512-bit kernel,
  // a row at a time into float32 for the 256-bit one.
  const Tensor x = x_in.contiguous();
  const bool bf16_in = x.scalar_type() == at::kBFloat16;
  const int64_t m = x.size(0);
  // The kernels write float32 into the result itself for a float32 caller. For a bf16 caller the
  // AVX-512 tiles round their outputs into it as they store them; the 256-bit and AMX kernels
  // write a float32 scratch that is rounded into it at the end (the same bits either way).
  Tensor result = at::empty({m, n}, x.options());
#if defined(__AVX512F__)
  const bool tiles_store_bf16 = bf16_in && isa != VectorIsa::kAvxVnni && !kvsentry_int8::amx_takes(type, m);
#else
  const bool tiles_store_bf16 = false;
#endif
  if (m > 0) {
    // [M, K] int8 quants (M rounded up to 16 with rows of zeros: the AMX path's tiles read 16
    // rows), [M, blocks] dx, sx, sum, half, the rows, [M, K] float32 of widened bf16 input, and
    // [M, N] float32 outputs for a bf16 caller.
    const size_t m16 = static_cast<size_t>((m + 15) / 16 * 16), mb = static_cast<size_t>(m * blocks);
    const bool widen = bf16_in && !quantizes_bf16(isa);  // bf16 rows widened to float32 first
    const size_t widened = widen ? static_cast<size_t>(m * k) : 0;
    const size_t outs = bf16_in && !tiles_store_bf16 ? static_cast<size_t>(m * n) : 0;
    thread_local Arena arena;
    arena.reset(Arena::line(m16 * k) + 4 * Arena::line(4 * mb) + Arena::line(sizeof(QuantRow) * m) +
                Arena::line(4 * widened) + Arena::line(4 * outs));
    int8_t* q = arena.take<int8_t>(m16 * k);
    if (m16 > static_cast<size_t>(m)) std::memset(q + m * k, 0, (m16 - m) * k);
    float* dx = arena.take<float>(mb);
    float* sx = arena.take<float>(mb);
    int32_t* sum = arena.take<int32_t>(mb);
    int32_t* half = arena.take<int32_t>(mb);
    QuantRow* rows = arena.take<QuantRow>(m);
    float* wide = arena.take<float>(widened);
    float* scratch = arena.take<float>(outs);
    const void* xs = x.data_ptr();
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        rows[r] = QuantRow{q + r * k, dx + r * blocks, sum + r * blocks, sx + r * blocks, half + r * blocks};
        const float* row = static_cast<const float*>(xs) + r * k;
        if (bf16_in && !widen) {
          quantize(isa, static_cast<const c10::BFloat16*>(xs) + r * k, blocks, rows[r]);
          continue;
        }
        if (widen) {
          const auto* raw = static_cast<const c10::BFloat16*>(xs) + r * k;
          float* widened_row = wide + r * k;
          for (int64_t i = 0; i < k; ++i) widened_row[i] = static_cast<float>(raw[i]);
          row = widened_row;
        }
        quantize(isa, row, blocks, rows[r]);
      }
    });
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    const uint8_t* w = packed.data_ptr<uint8_t>();
    float* out = bf16_in ? scratch : result.data_ptr<float>();
    c10::BFloat16* y16 = tiles_store_bf16 ? result.data_ptr<c10::BFloat16>() : nullptr;
    if (isa == VectorIsa::kAvxVnni) {
      kvsentry_int8::avx_vnni_gemm(type, w, groups, blocks, rows, m, b, out, n);
    } else if (kvsentry_int8::amx_takes(type, m)) {
      // Larger batches on AMX-INT8 tiles where the CPU has them (cpu_int8_gemm_amx.cpp): the same bits.
      kvsentry_int8::amx_gemm(type, w, groups, blocks, q, dx, sx, m, b, out, n);
    } else {
#if defined(__AVX512F__)
    if (type == kQ4_0) gemm_type<kQ4_0>(w, groups, blocks, rows, m, b, out, y16, n);
    if (type == kQ4_1) gemm_type<kQ4_1>(w, groups, blocks, rows, m, b, out, y16, n);
    if (type == kQ8_0) gemm_type<kQ8_0>(w, groups, blocks, rows, m, b, out, y16, n);
    if (type == kQ5_0) gemm_type<kQ5_0>(w, groups, blocks, rows, m, b, out, y16, n);
    if (type == kQ4_K) gemm_type<kQ4_K>(w, groups, blocks, rows, m, b, out, y16, n);
    if (type == kQ6_K) gemm_type<kQ6_K>(w, groups, blocks, rows, m, b, out, y16, n);
#endif
    }
    if (bf16_in && !tiles_store_bf16) {
      c10::BFloat16* y = result.data_ptr<c10::BFloat16>();
      at::parallel_for(0, m, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
        store_bf16_as_torch(out + begin * n, y + begin * n, (end - begin) * n);
      });
    }
    arena.trim();
  }
  return result;
}

Tensor gemm(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias, int64_t n) {
  return gemm_of(x, packed, bias, n);
}

Tensor gemm_parts(const Tensor& x, const Tensor& parts, const std::optional<Tensor>& bias, int64_t n) {
  TORCH_CHECK(parts.dim() == 1 && parts.scalar_type() == at::kByte && parts.is_contiguous() && parts.numel() >= 8,
              kOp, "_parts: parts must be a uint8 vector from int8_linear's Int8Parts");
  const uint8_t* bytes = parts.data_ptr<uint8_t>();
  const auto field = [&](int64_t i) {
    int64_t value;
    std::memcpy(&value, bytes + 8 * i, 8);
    return value;
  };
  const int64_t count = field(0);
  TORCH_CHECK(count > 0 && 8 * (1 + 4 * count) <= parts.numel(), kOp, "_parts: a header of ", count, " parts");
  int64_t offset = (8 * (1 + 4 * count) + 63) / 64 * 64, n0 = 0;
  std::vector<Tensor> outs;
  for (int64_t p = 0; p < count; ++p) {
    const int64_t np = field(1 + 4 * p), groups = field(2 + 4 * p), blocks = field(3 + 4 * p), size = field(4 + 4 * p);
    const int64_t length = groups * blocks * size;
    TORCH_CHECK(np > 0 && groups > 0 && blocks > 0 && size > 0 && offset + length <= parts.numel(), kOp,
                "_parts: part ", p, " does not fit");
    std::optional<Tensor> part_bias;
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, kOp, "_parts: bias must be [", n, "]");
      part_bias = bias->narrow(0, n0, np);
    }
    outs.push_back(gemm_of(x, parts.narrow(0, offset, length).view({groups, blocks, size}), part_bias, np));
    offset += length;
    n0 += np;
  }
  TORCH_CHECK(n0 == n && offset == parts.numel(), kOp, "_parts: the parts hold ", n0, " outputs, not ", n);
  return at::cat(outs, 1);
}

}  // namespace

namespace kvsentry_int8 {

VectorIsa vector_isa() {
#ifdef KVSENTRY_DEBUG_OPS
  const VectorIsa forced = g_forced.load(std::memory_order_relaxed);
  if (forced != VectorIsa::kNone) return forced;
#endif
  static const VectorIsa best = best_isa();
  return best;
}

const char* isa_name(VectorIsa isa) {
  return isa == VectorIsa::kAvx512Vnni ? "avx512_vnni" : isa == VectorIsa::kAvxVnni ? "avx_vnni" : "none";
}

}  // namespace kvsentry_int8

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("int8_gemm_pack(Tensor raw, int type, int k) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("int8_gemm_supported() -> bool", &supported);
  m.def("int8_gemm_parts(Tensor x, Tensor parts, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) {
  m.impl("int8_gemm_pack", &pack);
  m.impl("int8_gemm", &gemm);
  m.impl("int8_gemm_parts", &gemm_parts);
}

#ifdef KVSENTRY_DEBUG_OPS
TORCH_LIBRARY_FRAGMENT(kvsentry_debug, m) {
  m.def("int8_gemm_isa(str? isa=None) -> str", &choose_isa);
  m.def("int8_vnni_peak(int iterations) -> float", &vnni_peak);
}
#endif
