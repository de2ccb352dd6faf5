// The int8-activation GEMM of GGUF blocks (AVX512-VNNI): y = x W^T with x quantized per block of
// 32 values to int8 (a float32 scale per block, and its sum for Q4_1's minimum), multiplied with
// `vpdpbusd` against the weight's own Q4_0 / Q4_1 / Q8_0 blocks. The arithmetic, and the order
// of every float32 rounding, is engine/models/int8_reference.py's (tests/csrc/test_int8_gemm.py
// holds them to the same bits); each output is summed over K's blocks in order, the same way
// whatever batch its row is in.
//
//   packed = torch.ops.kvsentry.int8_gemm_pack(raw, type, k)
//            raw [N, K / 32 * block bytes] uint8: a GGUF tensor's rows of Q4_0 (type 2),
//            Q4_1 (3) or Q8_0 (8) -> [ceil(N / 16), K / 32, block bytes'] uint8
//   y = torch.ops.kvsentry.int8_gemm(x [M, K] float32 or bf16, packed, bias [N] or None, N) -> [M, N]
//   torch.ops.kvsentry.int8_gemm_supported() -> bool  built with AVX-512 and the CPU has AVX512-VNNI
//
// Packed layout: one block per 32 of K for a group of 16 outputs: the 16 scales as float16
// (Q4_1: then the 16 minima), then the quants as 64-byte vectors whose byte 4r + j belongs to
// output r: Q4_0 / Q4_1 4 vectors, vector c holding the GGUF byte 4c + j of output r (its low
// nibble K = 4c + j, its high nibble K = 16 + 4c + j); Q8_0 8 vectors, vector c the int8 at
// K = 4c + j plus 128 (vpdpbusd multiplies unsigned by signed bytes). The same bytes per weight
// as the file (the group's padding outputs aside): 0.5625 (Q4_0), 0.625 (Q4_1), 1.0625 (Q8_0).
// One vpdpbusd then adds 4 products for 16 outputs; a tile of 2 groups x 4 batch rows reuses
// each weight vector 4 times and each activation broadcast twice.
// On CPUs with AMX-INT8, batches of Q4_0 / Q4_1 / Q8_0 from a few rows up take the same blocks
// on tiles instead (cpu_int8_gemm_amx.cpp), to the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_amx.h"
#include "cpu_int8_gemm_amx.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using at::Tensor;
constexpr const char* kOp = "kvsentry::int8_gemm";
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML type ids
constexpr int64_t kBlockK = 32;
constexpr int64_t kGroup = 16;  // outputs per packed group: one int32 lane each

int64_t gguf_bytes(int64_t type) { return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ8_0 ? 34 : 0; }
int64_t scale_bytes(int64_t type) { return type == kQ4_1 ? 4 * kGroup : 2 * kGroup; }
int64_t quant_vectors(int64_t type) { return type == kQ8_0 ? 8 : 4; }
int64_t packed_bytes(int64_t type) { return scale_bytes(type) + 64 * quant_vectors(type); }
int64_t type_of(int64_t bytes) {
  for (int64_t type : {kQ4_0, kQ4_1, kQ8_0}) {
    if (packed_bytes(type) == bytes) return type;
  }
  return -1;
}

// One GGUF block (a row's 32 K) into output r of a packed block.
void place(const uint8_t* src, int64_t type, int64_t r, uint8_t* dst) {
  std::memcpy(dst + 2 * r, src, 2);  // the scale
  if (type == kQ4_1) std::memcpy(dst + 2 * kGroup + 2 * r, src + 2, 2);  // the minimum
  uint8_t* q = dst + scale_bytes(type);
  const uint8_t* qs = src + (type == kQ4_1 ? 4 : 2);
  if (type == kQ8_0) {
    for (int64_t k = 0; k < kBlockK; ++k) q[(k / 4) * 64 + 4 * r + k % 4] = static_cast<uint8_t>(qs[k] ^ 0x80);
  } else {
    for (int64_t k = 0; k < 16; ++k) q[(k / 4) * 64 + 4 * r + k % 4] = qs[k];
  }
}

Tensor pack(const Tensor& raw_in, int64_t type, int64_t k) {
  const int64_t bytes = gguf_bytes(type);
  TORCH_CHECK(bytes > 0, kOp, "_pack: GGML type ", type, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(k > 0 && k % kBlockK == 0, kOp, "_pack: K = ", k, " is not whole blocks of 32");
  const int64_t blocks = k / kBlockK;
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

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// The activations of one row, quantized per block: int8 quants, scale dx, the quants' sum and
// sx = dx * sum (as int8_reference.quantize_activations).
struct QuantRow {
  int8_t* q;
  float* dx;
  int32_t* sum;
  float* sx;
};

KVS_INT8_TARGET void quantize_row(const float* x, int64_t blocks, QuantRow out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float dx = amax / 127.0f;  // a division, as torch's (GCC keeps it without -ffast-math)
    const float inverse = dx != 0.0f ? 1.0f / dx : 0.0f;
    const __m512 scale = _mm512_set1_ps(inverse);
    // Rounded to nearest even (MXCSR's default), as torch.round.
    const __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(lo, scale, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(hi, scale, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + 32 * b), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + 32 * b + 16), _mm512_cvtepi32_epi8(qhi));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    out.dx[b] = dx;
    out.sum[b] = sum;
    out.sx[b] = dx * static_cast<float>(sum);
  }
}

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// Outputs of G groups (from `w`, `stride` bytes apart) for R batch rows: y[r][16 g + lane].
// The *_round_ps intrinsics keep every product and sum its own rounding (no contraction to FMA).
template <int64_t kType, int G, int R>
KVS_INT8_TARGET void tile(const uint8_t* w, int64_t stride, int64_t blocks, const QuantRow* rows, const float* bias,
                          float* const* out, int valid) {
  constexpr int64_t kBytes = kType == kQ4_1 ? 320 : kType == kQ4_0 ? 288 : 544;
  constexpr int64_t kScales = kType == kQ4_1 ? 64 : 32;
  __m512 acc[G][R];
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i isum[G][R];
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) isum[g][r] = _mm512_setzero_si512();
    }
    if (kType == kQ8_0) {
      #pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        __m512i wv[G];
        #pragma GCC unroll 8
        for (int g = 0; g < G; ++g) wv[g] = _mm512_loadu_si512(w + g * stride + b * kBytes + kScales + 64 * c);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, rows[r].q + 32 * b + 4 * c, 4);
          const __m512i xv = _mm512_set1_epi32(x4);
          #pragma GCC unroll 8
          for (int g = 0; g < G; ++g) isum[g][r] = _mm512_dpbusd_epi32(isum[g][r], wv[g], xv);
        }
      }
    } else {
      #pragma GCC unroll 8
      for (int c = 0; c < 4; ++c) {
        __m512i lo[G], hi[G];
        #pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const __m512i v = _mm512_loadu_si512(w + g * stride + b * kBytes + kScales + 64 * c);
          lo[g] = _mm512_and_si512(v, low);
          hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t xl, xh;
          std::memcpy(&xl, rows[r].q + 32 * b + 4 * c, 4);
          std::memcpy(&xh, rows[r].q + 32 * b + 16 + 4 * c, 4);
          const __m512i vl = _mm512_set1_epi32(xl), vh = _mm512_set1_epi32(xh);
          #pragma GCC unroll 8
          for (int g = 0; g < G; ++g) {
            isum[g][r] = _mm512_dpbusd_epi32(isum[g][r], lo[g], vl);
            isum[g][r] = _mm512_dpbusd_epi32(isum[g][r], hi[g], vh);
          }
        }
      }
    }
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const uint8_t* block = w + g * stride + b * kBytes;
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
      __m512 mw = _mm512_setzero_ps();
      if (kType == kQ4_1) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512i dot = isum[g][r];
        // Unsigned weights back to their signed values: Q4_0 nibble - 8, Q8_0 byte - 128 (exact).
        if (kType == kQ4_0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * rows[r].sum[b]));
        if (kType == kQ8_0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * rows[r].sum[b]));
        const __m512 scale = _mm512_mul_round_ps(dw, _mm512_set1_ps(rows[r].dx[b]), kRound);
        __m512 term = _mm512_mul_round_ps(scale, _mm512_cvtepi32_ps(dot), kRound);
        if (kType == kQ4_1) term = _mm512_add_round_ps(term, _mm512_mul_round_ps(mw, _mm512_set1_ps(rows[r].sx[b]), kRound), kRound);
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
      _mm512_mask_storeu_ps(out[r] + 16 * g, mask, y);
    }
  }
}

template <int64_t kType, int G>
KVS_INT8_TARGET void rows_of(const uint8_t* w, int64_t stride, int64_t blocks, const QuantRow* rows, int64_t m,
                             const float* bias, float* y, int64_t n, int64_t n0) {
  const int valid = static_cast<int>(std::min<int64_t>(G * kGroup, n - n0));
  for (int64_t m0 = 0; m0 < m; m0 += 4) {
    float* out[4];
    for (int r = 0; r < 4; ++r) out[r] = y + (m0 + r) * n + n0;
    const float* b = bias != nullptr ? bias + n0 : nullptr;
    switch (std::min<int64_t>(4, m - m0)) {
      case 4: tile<kType, G, 4>(w, stride, blocks, rows + m0, b, out, valid); break;
      case 3: tile<kType, G, 3>(w, stride, blocks, rows + m0, b, out, valid); break;
      case 2: tile<kType, G, 2>(w, stride, blocks, rows + m0, b, out, valid); break;
      default: tile<kType, G, 1>(w, stride, blocks, rows + m0, b, out, valid); break;
    }
  }
}

template <int64_t kType>
void gemm_type(const uint8_t* packed, int64_t groups, int64_t blocks, const QuantRow* rows, int64_t m,
               const float* bias, float* y, int64_t n) {
  const int64_t stride = blocks * packed_bytes(kType);
  const int64_t pairs = (groups + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* w = packed + 2 * p * stride;
      if (2 * p + 1 < groups) {
        rows_of<kType, 2>(w, stride, blocks, rows, m, bias, y, n, 2 * p * kGroup);
      } else {
        rows_of<kType, 1>(w, stride, blocks, rows, m, bias, y, n, 2 * p * kGroup);
      }
    }
  });
}
#else
bool supported() { return false; }
#endif

Tensor gemm(const Tensor& x_in, const Tensor& packed, const std::optional<Tensor>& bias_in, int64_t n) {
  TORCH_CHECK(supported(), kOp, ": this CPU (or build) has no AVX512-VNNI");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  type_of(packed.size(2)) >= 0,
              kOp, ": packed must come from int8_gemm_pack");
  const int64_t type = type_of(packed.size(2)), groups = packed.size(0), blocks = packed.size(1);
  const int64_t k = blocks * kBlockK;
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
  const Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0);
  Tensor y = at::empty({m, n}, x.options());
#if defined(__AVX512F__)
  if (m > 0) {
    // [M, K] int8 quants (on a cache line, and M rounded up to 16 with rows of zeros: the AMX
    // path's tiles read 16 rows), then [M, blocks] dx, sum, sx.
    kvsentry_amx::TileBuffer<int8_t> q(static_cast<size_t>((m + 15) / 16 * 16 * k));
    std::vector<float> dx(static_cast<size_t>(m * blocks)), sx(dx.size());
    std::vector<int32_t> sum(dx.size());
    std::vector<QuantRow> rows(static_cast<size_t>(m));
    const float* xs = x.data_ptr<float>();
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        rows[r] = QuantRow{q.data() + r * k, dx.data() + r * blocks, sum.data() + r * blocks, sx.data() + r * blocks};
        quantize_row(xs + r * k, blocks, rows[r]);
      }
    });
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    const uint8_t* w = packed.data_ptr<uint8_t>();
    float* out = y.data_ptr<float>();
    // Larger batches on AMX-INT8 tiles where the CPU has them (cpu_int8_gemm_amx.cpp): the same bits.
    if (kvsentry_int8::amx_takes(type, m)) {
      kvsentry_int8::amx_gemm(type, w, groups, blocks, q.data(), dx.data(), sx.data(), m, b, out, n);
      return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
    }
    if (type == kQ4_0) gemm_type<kQ4_0>(w, groups, blocks, rows.data(), m, b, out, n);
    if (type == kQ4_1) gemm_type<kQ4_1>(w, groups, blocks, rows.data(), m, b, out, n);
    if (type == kQ8_0) gemm_type<kQ8_0>(w, groups, blocks, rows.data(), m, b, out, n);
  }
#endif
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("int8_gemm_pack(Tensor raw, int type, int k) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("int8_gemm_supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) {
  m.impl("int8_gemm_pack", &pack);
  m.impl("int8_gemm", &gemm);
}
