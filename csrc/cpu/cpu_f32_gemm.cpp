// A float32 GEMM for the linear layers of small steps on CPUs with AVX-512.
//
//   packed = torch.ops.kvsentry.f32_gemm_pack(weight)         weight [N, K] float32
//            -> [ceil(N / 64), K, 64] float32: 64-output panels, one 256-byte row per K
//               (outputs past N are zeros, never stored)
//   y = torch.ops.kvsentry.f32_gemm(x, packed, bias, N)        x [M, K] float32 (stride 1 in K)
//            -> [M, N] float32: x @ weight^T (+ bias); `packed` may also be quant_panels_pack's
//            GGUF blocks (cpu_quant_panels.h), dequantized a block at a time into L1 for a row
//            tile of up to 6 rows, a panel at a time into L2 for more: bit for bit the same
//   torch.ops.kvsentry.f32_gemm_supported() -> bool             built with it and the CPU has AVX-512F
//
// Why: a float32 decode step at a few rows reads every weight once (4 bytes per 2 FLOP per
// row), so its linears are bound by the memory stream. oneDNN's prepacked float32 kernels
// read the default model's 30 layers at ~9.8 GB/s at 1 row and ~8.9 GB/s at 8 rows on a
// 1-core Xeon, where the memory gives ~13-15 GB/s to one core. Here a panel of 64 outputs is
// one contiguous stream of 256 bytes (4 cache lines) per K, multiplied into a 6 x 4 register
// tile of float32 accumulators by the x row's broadcast: memory bound up to ~6 rows and near
// the FMA peak beyond, the panel staying in L2 across row tiles. A single row walks four
// panels at once (four streams in flight). From some tens of rows
// oneDNN's blocking is faster; engine/models/cpu_gemm.py sends those to oneDNN
// (F32_PANEL_MAX_ROWS).
//
// Numerics: each output is bias + sum over k of x[k] * w[k], summed in K order by fused
// multiply-adds (one rounding per k) and the bias added last, as a plain float32 dot product
// would; only the summation order differs from oneDNN's, so results agree to float32 rounding
// of the sums (tests/csrc/test_f32_gemm.py holds it to a float64 reference).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

#include "cpu_f32_gemm.h"
#include "cpu_panel_gemm.h"
#include "cpu_quant_panels.h"

namespace {

using at::Tensor;
constexpr const char* kOp = "kvsentry::f32_gemm";
using kvsentry_panels::kPanel;
using kvsentry_panels::kRows;
// How far ahead (8 K rows of the panel) a tile of 2 or more rows prefetches the panel. With a
// few rows' multiply-adds per K the out-of-order window alone no longer covers enough of the
// stream: on a 1-core Xeon, 30 layers at 4 rows 44 -> 39 ms, at 8 rows 55 -> 46 ms (1024 and
// 4096 bytes measured the same). One row streams faster without it (32 vs 33-35 ms).
constexpr int64_t kPrefetchBytes = 2048;
// Panels a single row walks at once, one stream each: 30 layers at 1 row 29-31 -> 28-28.6 ms
// on a 1-core Xeon (2 and 3 measured in between).
constexpr int kRowPanels = 4;

#if defined(__AVX512F__)
using kvsentry_panels::output_chunk;

bool supported() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// y[r, chunk c] = acc[r][c] + bias for the outputs within `width`.
template <int R, int C>
__attribute__((target("avx512f"), always_inline)) inline void store_tile(const __m512 (&acc)[R][C], const float* bias,
                                                                        float* y, int64_t ys, int64_t width) {
  for (int c = 0; c < C; ++c) {
    __mmask16 mask;
    __m512 b;
    if (!output_chunk(c, width, bias, mask, b)) break;
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ys + 16 * c, mask, _mm512_add_ps(acc[r][c], b));
  }
}

// acc[r][16 c : 16 c + 16] += x[r, p] * (the P panels side by side)[p][16 c : 16 c + 16] for p
// in [0, k): R rows of x (row stride xs) against P adjacent panels; then y[r, 0:width] = acc +
// bias (rows of stride ys, `width` valid outputs over the P panels).
template <int R, int P>
__attribute__((target("avx512f"))) void tile(const float* x, int64_t xs, const float* panel, int64_t k,
                                             const float* bias, float* y, int64_t ys, int64_t width) {
  __m512 acc[R][4 * P];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4 * P; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  const int64_t stride = k * kPanel;  // floats from one panel to the next
  const float* w = panel;
  for (int64_t p = 0; p < k; ++p, w += kPanel) {
    if (R > 1) {  // see kPrefetchBytes
      const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      _mm_prefetch(ahead + 128, _MM_HINT_T0);
      _mm_prefetch(ahead + 192, _MM_HINT_T0);
    }
    for (int q = 0; q < P; ++q) {
      __m512 wq[4];
      for (int j = 0; j < 4; ++j) wq[j] = _mm512_loadu_ps(w + q * stride + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * xs + p]);
        for (int j = 0; j < 4; ++j) acc[r][4 * q + j] = _mm512_fmadd_ps(xb, wq[j], acc[r][4 * q + j]);
      }
    }
  }
  store_tile<R, 4 * P>(acc, bias, y, ys, width);
}

// acc[r][j] += x[r, p] * w[p][16 j : 16 j + 16] for p in [0, k): R rows against one panel's
// rows of 64 floats, one fused multiply-add per p, in K order (tile<R, 1>'s arithmetic).
template <int R>
__attribute__((target("avx512f"), always_inline)) inline void multiply_adds(const float* x, int64_t xs, const float* w,
                                                                           int64_t k, __m512 (&acc)[R][4]) {
  for (int64_t p = 0; p < k; ++p, w += kPanel) {
    __m512 wq[4];
    for (int j = 0; j < 4; ++j) wq[j] = _mm512_load_ps(w + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * xs + p]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xb, wq[j], acc[r][j]);
    }
  }
}

// tile<R, 1> against a GGUF-quantized panel: each block of 32 K is dequantized into L1 (two
// buffers in turn) right before its multiply-adds, in the same K order, the accumulators in
// registers throughout. For one row tile (up to kRows rows): more would dequantize again.
// kBf16: the weights rounded to bf16 as they dequantize (dequant_f32), here and below.
template <int R, bool kBf16>
__attribute__((target("avx512f"))) void tile_dequant(const float* x, int64_t xs, const kvsentry_quant::Panels& quant,
                                                     int64_t panel, const float* bias, float* y, int64_t ys,
                                                     int64_t width) {
  constexpr int64_t kBlockK = kvsentry_quant::kBlockK;
  alignas(64) float blocks[2][kBlockK * kPanel];
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < quant.blocks; ++b) {
    kvsentry_quant::dequant_f32<kBf16>(quant, panel, b, b + 1, blocks[b & 1]);
    multiply_adds<R>(x + b * kBlockK, xs, blocks[b & 1], kBlockK, acc);
  }
  store_tile<R, 4>(acc, bias, y, ys, width);
}

// acc [R][64] (+)= x[:, one block's 32 K] . w (a dequantized block, [32][64]): R rows' accumulators,
// kept in memory (L1) between blocks, from zero on the first; tile<R, 1>'s multiply-adds in order.
template <int R>
__attribute__((target("avx512f"))) void block_tile(const float* x, int64_t xs, const float* w, float* acc_mem,
                                                   bool first) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc_mem + r * kPanel + 16 * j);
  }
  multiply_adds<R>(x, xs, w, kvsentry_quant::kBlockK, acc);
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_store_ps(acc_mem + r * kPanel + 16 * j, acc[r][j]);
  }
}

using BlockTileFn = void (*)(const float*, int64_t, const float*, float*, bool);
constexpr BlockTileFn kBlockTiles[kRows + 1] = {nullptr,       block_tile<1>, block_tile<2>, block_tile<3>,
                                                block_tile<4>, block_tile<5>, block_tile<6>};
// Rows up to which rows_dequant serves (their accumulators in L1, 8 KB); beyond, a panel is
// dequantized into L2 first and the row tiles walk it (the multiply-adds outweigh the reloads).
constexpr int64_t kDequantRows = 32;

// More than one row tile (up to kDequantRows rows) against a GGUF-quantized panel: each block
// dequantized once into L1, then every row tile's multiply-adds over it. The default model's
// 30 layers against the panel dequantized into L2 first (1-core Xeon, alternating): 18.2-19.3
// -> 14.8-14.9 ms at 8 rows, 25.2 -> 23.0 at 16, 42.0 -> 40.4 at 32; 47.8 -> 48.9 at 40, and
// 70.4 -> 75.9 at 64, where the accumulators' reloads outweigh the L2 reads.
template <bool kBf16>
__attribute__((target("avx512f"))) void rows_dequant(const float* x, int64_t xs, int64_t m,
                                                     const kvsentry_quant::Panels& quant, int64_t panel,
                                                     const float* bias, float* y, int64_t ys, int64_t width) {
  constexpr int64_t kBlockK = kvsentry_quant::kBlockK;
  alignas(64) float block[kBlockK * kPanel];
  alignas(64) float acc[kDequantRows * kPanel];
  for (int64_t b = 0; b < quant.blocks; ++b) {
    kvsentry_quant::dequant_f32<kBf16>(quant, panel, b, b + 1, block);
    for (int64_t r = 0; r < m; r += kRows) {
      kBlockTiles[std::min(kRows, m - r)](x + r * xs + b * kBlockK, xs, block, acc + r * kPanel, b == 0);
    }
  }
  for (int c = 0; c < 4; ++c) {
    __mmask16 mask;
    __m512 bc;
    if (!output_chunk(c, width, bias, mask, bc)) break;
    for (int64_t r = 0; r < m; ++r) {
      _mm512_mask_storeu_ps(y + r * ys + 16 * c, mask, _mm512_add_ps(_mm512_load_ps(acc + r * kPanel + 16 * c), bc));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr TileFn kTiles[kRows + 1] = {nullptr, tile<1, 1>, tile<2, 1>, tile<3, 1>, tile<4, 1>, tile<5, 1>, tile<6, 1>};
using DequantTileFn = void (*)(const float*, int64_t, const kvsentry_quant::Panels&, int64_t, const float*, float*,
                               int64_t, int64_t);
template <bool kBf16>
constexpr DequantTileFn kDequantTiles[kRows + 1] = {
    nullptr, tile_dequant<1, kBf16>, tile_dequant<2, kBf16>, tile_dequant<3, kBf16>,
    tile_dequant<4, kBf16>, tile_dequant<5, kBf16>, tile_dequant<6, kBf16>};

// y [m, n] = x [m, k] (row stride xs) . W^T + bias for W the float32 panels `wp` or the
// quantized panels `qp` (one of them null), whose values kBf16 rounds to bf16: gemm's loops.
template <bool kBf16>
void run(const float* xp, int64_t xs, int64_t m, int64_t k, const float* wp, const kvsentry_quant::Panels* qp,
         int64_t panels, const float* bp, float* yp, int64_t n) {
  if (m == 1 && qp == nullptr) {  // groups of kRowPanels panels, then one at a time; threads split the panels
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t panel = begin; panel < end;) {
        const int64_t col = panel * kPanel, group = panel + kRowPanels <= end ? kRowPanels : 1;
        (group == kRowPanels ? tile<1, kRowPanels> : tile<1, 1>)(xp, xs, wp + panel * k * kPanel, k,
                                                                 bp != nullptr ? bp + col : nullptr, yp + col, n,
                                                                 std::min(group * kPanel, n - col));
        panel += group;
      }
    });
    return;
  }
  if (qp != nullptr && m <= kDequantRows) {  // each panel dequantized block by block as it goes
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t col = panel * kPanel, width = std::min(kPanel, n - col);
        const float* bias_p = bp != nullptr ? bp + col : nullptr;
        if (m <= kRows) {
          kDequantTiles<kBf16>[m](xp, xs, *qp, panel, bias_p, yp + col, n, width);  // accumulators in registers
        } else {
          rows_dequant<kBf16>(xp, xs, m, *qp, panel, bias_p, yp + col, n, width);
        }
      }
    });
    return;
  }
  kvsentry_panels::for_row_tiles(
      m, panels,
      [&](int64_t panel) { return qp != nullptr ? kvsentry_quant::f32_panel<kBf16>(*qp, panel) : wp + panel * k * kPanel; },
      [&](const float* w, int64_t panel, int64_t r, int64_t rows) {
        const int64_t col = panel * kPanel;
        kTiles[rows](xp + r * xs, xs, w, k, bp != nullptr ? bp + col : nullptr, yp + r * n + col, n,
                     std::min(kPanel, n - col));
      });
}
#else
bool supported() { return false; }
#endif

Tensor pack(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "kvsentry::f32_gemm_pack: weight must be a CPU float32 [N, K] tensor");
  const Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  Tensor packed = at::zeros({panels, k, kPanel}, w.options());
  kvsentry_panels::pack_panels(w.data_ptr<float>(), n, k, packed.data_ptr<float>(),
                               [k](int64_t panel, int64_t o, int64_t c) { return (panel * k + c) * kPanel + o; });
  return packed;
}

Tensor gemm(const Tensor& x_in, const Tensor& packed, const std::optional<Tensor>& bias, int64_t n) {
  TORCH_CHECK(supported(), kOp, ": this CPU (or build) has no AVX-512F");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), kOp,
              ": x must be a CPU float32 [M, K] tensor");
  // The packed weight: f32_gemm_pack's float32 panels, or quant_panels_pack's GGUF blocks.
  const bool quant = packed.scalar_type() == at::kByte;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  (quant ? kvsentry_quant::type_of(packed.size(2)) >= 0
                         : packed.scalar_type() == at::kFloat && packed.size(2) == kPanel),
              kOp, ": packed must come from f32_gemm_pack or quant_panels_pack");
  const int64_t m = x_in.size(0), k = x_in.size(1), panels = packed.size(0);
  const int64_t packed_k = quant ? packed.size(1) * kvsentry_quant::kBlockK : packed.size(1);
  TORCH_CHECK(packed_k == k && n > (panels - 1) * kPanel && n <= panels * kPanel, kOp, ": x [", m, ", ", k,
              "] and N = ", n, " do not fit the packed weight ", packed.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, kOp, ": bias must be [N]");
  }
  Tensor y = at::empty({m, n}, x_in.options());
  if (m == 0) return y;
  const Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : Tensor();
#if defined(__AVX512F__)
  const auto qp = quant ? kvsentry_quant::Panels::of(packed.data_ptr<uint8_t>(), packed.size(1), packed.size(2))
                        : kvsentry_quant::Panels{};
  run<false>(x.data_ptr<float>(), x.stride(0), m, k, quant ? nullptr : packed.data_ptr<float>(),
             quant ? &qp : nullptr, panels, b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), n);
#endif
  return y;
}

bool gemm_supported() { return supported(); }

}  // namespace

namespace kvsentry_f32 {

bool supported() { return ::supported(); }

at::Tensor bf16_quant_gemm(const at::Tensor& xf, const kvsentry_quant::Panels& quant, int64_t panels,
                           const float* bias, int64_t n) {
  TORCH_CHECK(::supported(), kOp, ": this CPU (or build) has no AVX-512F");
  const int64_t m = xf.size(0), k = xf.size(1);
  TORCH_CHECK(xf.scalar_type() == at::kFloat && xf.is_contiguous() && quant.blocks * kvsentry_quant::kBlockK == k,
              kOp, ": bf16_quant_gemm takes a contiguous float32 x of the blocks' K");
  at::Tensor y = at::empty({m, n}, xf.options());
#if defined(__AVX512F__)
  if (m > 0) run<true>(xf.data_ptr<float>(), k, m, k, nullptr, &quant, panels, bias, y.data_ptr<float>(), n);
#endif
  return y;
}

}  // namespace kvsentry_f32

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("f32_gemm_pack(Tensor weight) -> Tensor");
  m.def("f32_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("f32_gemm_supported() -> bool", &gemm_supported);
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) {
  m.impl("f32_gemm_pack", &pack);
  m.impl("f32_gemm", &gemm);
}
