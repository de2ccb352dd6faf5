// A bfloat16 GEMM for the linear layers of decode steps on CPUs with AVX512-BF16.
//
//   packed = torch.ops.kvsentry.bf16_gemm_pack(weight)        weight [N, K] bf16
//            -> [ceil(N / 64), ceil(K / 2), 64, 2] bf16: 64-output panels, K in pairs
//   y = torch.ops.kvsentry.bf16_gemm(x, packed, bias, N)        x [M, K] bf16 (rows contiguous)
//            -> [M, N] bf16: x @ weight^T (+ bias), products summed in float32, rounded once
//   torch.ops.kvsentry.bf16_gemm_supported() -> bool            built with it and the CPU has it
//
// Why: a decode step's linears read every weight once for a few rows. oneDNN's kernels for
// those shapes (avx512_core_bf16 on CPUs without AMX) run far below both the memory and the
// compute limit there: on a 1-core Zen 5, the default model's 30 layers take 9.7 ms at 8 rows
// (5.5 ms to stream the weights) and 19.4 ms at 32 rows (12.7 ms at the GEMM peak). Here a
// panel of 64 outputs is one contiguous stream of 256 bytes per pair of K, and each pair is
// vdpbf16ps'ed into a 6 x 4 register tile of float32 accumulators straight from the x row's
// embedded broadcast: 24 multiply-adds of 32 products per 4 cache lines, memory bound up to
// 6 rows and near the FMA peak beyond (the panel stays in L2 across row tiles).
//
// Numerics: vdpbf16ps multiplies bf16 pairs exactly and adds in float32 (denormal inputs and
// results read as zero, round to nearest even), summing K in order two at a time; the bias is
// added in float32 and the result rounded to bf16 once, as oneDNN does -- only the summation
// order differs from oneDNN's, so results agree to float32 rounding of the sums
// (tests/csrc/test_bf16_gemm.py holds it to a float64 reference).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <algorithm>
#include <cstring>

namespace {

using at::Tensor;
constexpr const char* kOp = "kvsentry::bf16_gemm";
constexpr int64_t kPanel = 64;  // outputs per panel: 4 vectors of 16 float32 accumulators
constexpr int64_t kRows = 6;    // rows per register tile: 6 x 4 accumulators + 4 weight vectors
constexpr int64_t kChunk = 96;  // rows per pass over the panels: their x stays in L2

// Only in AVX-512 builds (KVSENTRY_CPU_ARCH=AVX2 caps the ISA: such a build uses oneDNN).
#if defined(__AVX512F__)
bool supported() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return has;
}

// acc[r][j] += x[r, 2p : 2p + 2] . w[p][16 j : 16 j + 16] for p in [0, pairs): R rows of x
// (row stride xs, in 32-bit pairs) against one panel; out rows of stride ys, `width` valid outputs.
template <int R>
__attribute__((target("avx512f,avx512bf16"))) void tile(const uint32_t* x, int64_t xs, const uint16_t* panel,
                                                        int64_t pairs, const float* bias, uint16_t* y,
                                                        int64_t ys, int64_t width) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  const uint16_t* w = panel;
  for (int64_t p = 0; p < pairs; ++p, w += 2 * kPanel) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + 2048, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 128, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 192, _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * xs + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t left = width - 16 * j;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
      _mm256_mask_storeu_epi16(y + r * ys + 16 * j, mask, (__m256i)out);
    }
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t,
                        int64_t);
constexpr TileFn kTiles[kRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};
#else
bool supported() { return false; }
#endif

Tensor pack(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "kvsentry::bf16_gemm_pack: weight must be a CPU bfloat16 [N, K] tensor");
  const Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel, pairs = (k + 1) / 2;
  // Zero padding: past N the outputs are never stored, past K the products are 0 * x.
  Tensor packed = at::zeros({panels, pairs, kPanel, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t o = 0; o < kPanel && panel * kPanel + o < n; ++o) {
        const uint16_t* row = src + (panel * kPanel + o) * k;
        for (int64_t c = 0; c < k; ++c) {
          dst[((panel * pairs + c / 2) * kPanel + o) * 2 + c % 2] = row[c];
        }
      }
    }
  });
  return packed;
}

Tensor gemm(const Tensor& x_in, const Tensor& packed, const std::optional<Tensor>& bias, int64_t n) {
  TORCH_CHECK(supported(), kOp, ": this CPU (or build) has no AVX512-BF16");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(), kOp,
              ": x must be a CPU bfloat16 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == kPanel &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              kOp, ": packed must come from bf16_gemm_pack");
  const int64_t m = x_in.size(0), k = x_in.size(1), panels = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(pairs == (k + 1) / 2 && n > (panels - 1) * kPanel && n <= panels * kPanel, kOp, ": x [", m, ", ", k,
              "] and N = ", n, " do not fit the packed weight ", packed.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, kOp, ": bias must be [N]");
  }
  Tensor y = at::empty({m, n}, x_in.options());
  if (m == 0) return y;
  // x as 32-bit pairs: rows contiguous and of even length (an odd K gets a zero column).
  Tensor x = x_in;
  if (k % 2 != 0 || x.stride(1) != 1 || x.stride(0) % 2 != 0 || (reinterpret_cast<uintptr_t>(x.data_ptr()) & 3)) {
    x = at::zeros({m, 2 * pairs}, x_in.options());
    x.narrow(1, 0, k).copy_(x_in);
  }
  const Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : Tensor();
#if defined(__AVX512F__)
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const int64_t xs = x.stride(0) / 2;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  // Threads split the panels; each walks its panels once per chunk of rows.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kChunk) {
      const int64_t r1 = std::min(m, r0 + kChunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        const uint16_t* w = wp + panel * pairs * 2 * kPanel;
        const int64_t col = panel * kPanel, width = std::min(kPanel, n - col);
        for (int64_t r = r0; r < r1; r += kRows) {
          const int64_t rows = std::min(kRows, r1 - r);
          kTiles[rows](xp + r * xs, xs, w, pairs, bp != nullptr ? bp + col : nullptr, yp + r * n + col, n, width);
        }
      }
    }
  });
#endif
  return y;
}

bool gemm_supported() { return supported(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("bf16_gemm_pack(Tensor weight) -> Tensor");
  m.def("bf16_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("bf16_gemm_supported() -> bool", &gemm_supported);
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) {
  m.impl("bf16_gemm_pack", &pack);
  m.impl("bf16_gemm", &gemm);
}
