// A bfloat16 GEMM for the linear layers of decode steps on CPUs with AVX512-BF16 (and of every
// step on CPUs with AVX-512F alone, where oneDNN's bf16 is an emulation).
//
//   packed = torch.ops.kvsentry.bf16_gemm_pack(weight)        weight [N, K] bf16
//            -> [ceil(N / 64), 16 ceil(K / 32), 64, 2] bf16: 64-output panels, K in pairs
//               (zero-padded to whole blocks of 16 pairs, an AMX tile's depth; the packed
//               weight knows K only to that granule: an x with K in the same 32 is accepted)
//   y = torch.ops.kvsentry.bf16_gemm(x, packed, bias, N)        x [M, K] bf16 (rows contiguous)
//            -> [M, N] bf16: x @ weight^T (+ bias), products summed in float32, rounded once;
//            `packed` may also be quant_panels_pack's GGUF blocks (cpu_quant_panels.h), each
//            block dequantized into L1 right before its tiles: the same results, bit for bit;
//            or, for the "amx" kernel, quant_rows_pack's Q4_1 blocks in the rows layout (the
//            weight as the tiles' A operand, looked up per output and block): the same bits again
//   y = torch.ops.kvsentry_debug.bf16_gemm_with(x, packed, bias, N, kernel)   one kernel by name
//            (the test build only: engine/ops/library.py, debug=True)
//   torch.ops.kvsentry.bf16_gemm_supported() -> bool            built with it and the CPU has it
//   torch.ops.kvsentry.bf16_gemm_kernels() -> str[]             the kernels this CPU runs, best first:
//            "amx" (AMX-BF16 tiles), "avx512_bf16" (vdpbf16ps) and "avx512f" (float32 FMAs on
//            the widened values); bf16_gemm takes the first
//
// Why: a decode step's linears read every weight once for a few rows. oneDNN's kernels for
// those shapes (avx512_core_bf16 on CPUs without AMX) run far below both the memory and the
// compute limit there: on a 1-core Zen 5, the default model's 30 layers take 9.7 ms at 8 rows
// (5.5 ms to stream the weights) and 19.4 ms at 32 rows (12.7 ms at the GEMM peak). Here a
// panel of 64 outputs is one contiguous stream of 256 bytes per pair of K, and each pair is
// vdpbf16ps'ed into a 7 x 4 register tile of float32 accumulators straight from the x row's
// embedded broadcast: 28 multiply-adds of 32 products per 4 cache lines, memory bound up to
// 7 rows and near the FMA peak beyond (the panel stays in L2 across row tiles).
//
// On CPUs with AMX (Intel Sapphire Rapids and later) the same panels are AMX B tiles as they
// lie: 16 pairs of K by 16 outputs, rows 256 bytes apart. Four C tiles hold 16 rows x 64
// outputs; each block of 32 K loads one A tile of x and the panel's four B tiles in address
// order, so the weight is still one contiguous stream, left to the hardware prefetcher: software
// prefetches of it (two blocks ahead, or into L2 from every pass) measured 5-20% slower at
// 1-128 rows on a 1-core Xeon, their instructions stalling on full miss queues -- except for
// 49-64 rows, whose three L1-bound passes over a chunk have room to bring the next one into
// L2 (kAheadPasses). On a
// 1-core Xeon with AMX, oneDNN's AMX kernels read a decode step's weights at ~50-60% of the
// memory bandwidth and these tiles 1.43x faster at 1 row, 1.37x at 8, 1.12x at 64; from ~128
// rows oneDNN's blocking is faster (1.1 vs 0.6 TFLOP/s at 1024 rows), so
// engine/models/cpu_gemm.py keeps oneDNN for those (AMX_PANEL_MAX_ROWS).
//
// CPUs with AVX-512F but neither AVX512-BF16 nor AMX (Skylake-SP to Ice Lake, or a VM hiding
// the flags) run "avx512f": the same panels, each pair widened to two float32 (a shift and a
// mask) and multiplied with FMAs; GGUF blocks there go through the float32 GEMM
// (cpu_f32_gemm.h), dequantized and rounded to bf16. oneDNN's bf16 on such a CPU emulates the
// products at ~30 GFLOP/s on one Xeon core; these run 1.6x faster at 1 row and ~4.4x from 32
// rows (benchmarks/bf16_gemm.py).
//
// Numerics: vdpbf16ps multiplies bf16 pairs exactly and adds in float32 (denormal inputs and
// results read as zero, round to nearest even), summing K in order two at a time; the bias is
// added in float32 and the result rounded to bf16 once, as oneDNN does -- only the summation
// order differs from oneDNN's, so results agree to float32 rounding of the sums
// (tests/csrc/test_bf16_gemm.py holds it to a float64 reference). "avx512f" sums K one at a
// time by FMAs (one rounding per product-add, no denormal flush), as the float32 GEMM does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_amx.h"
#include "cpu_bf16_amx.h"
#include "cpu_f32_gemm.h"
#include "cpu_panel_gemm.h"
#include "cpu_prefetch.h"
#include "cpu_quant_panels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using at::Tensor;
constexpr const char* kOp = "kvsentry::bf16_gemm";
using kvsentry_panels::kPanel;
using kvsentry_panels::kRows;
using kvsentry_bf16_amx::kAmxRowChunk;
using kvsentry_bf16_amx::kChunkBlocks;
using kvsentry_bf16_amx::kDepth;
using kvsentry_bf16_amx::kTileRows;

int64_t padded_pairs(int64_t k) { return (k + 2 * kDepth - 1) / (2 * kDepth) * kDepth; }

// Only in AVX-512 builds (KVSENTRY_CPU_ARCH=AVX2 caps the ISA: such a build uses oneDNN).
#if defined(__AVX512F__)
using kvsentry_panels::output_chunk;

bool supported() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return has;
}

// What both vector tiles do per pair of K: ask for the panel's 4 lines 2 KB ahead into L1
// (spelled out, not a loop: GCC has deleted loops of prefetches alone, see cpu_prefetch.h).
inline void prefetch_pair_ahead(const uint16_t* w) {
  const char* ahead = reinterpret_cast<const char*>(w) + 2048;
  _mm_prefetch(ahead, _MM_HINT_T0);
  _mm_prefetch(ahead + 64, _MM_HINT_T0);
  _mm_prefetch(ahead + 128, _MM_HINT_T0);
  _mm_prefetch(ahead + 192, _MM_HINT_T0);
}

template <int R>
__attribute__((target("avx512f"), always_inline)) inline void zero(__m512 (&acc)[R][4]) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
}

// acc[r][j] += x[r, 2p : 2p + 2] . w[p][16 j : 16 j + 16] for p in [0, pairs): R rows of x
// (row stride xs, in 32-bit pairs) against one panel; out rows of stride ys, `width` valid outputs.
template <int R>
__attribute__((target("avx512f,avx512bf16"))) void tile(const uint32_t* x, int64_t xs, const uint16_t* panel,
                                                        int64_t pairs, const float* bias, uint16_t* y,
                                                        int64_t ys, int64_t width) {
  __m512 acc[R][4];
  zero(acc);
  const uint16_t* w = panel;
  for (int64_t p = 0; p < pairs; ++p, w += 2 * kPanel) {
    prefetch_pair_ahead(w);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int r = 0; r < R; ++r) {
      // x's broadcast last, where it can be the instruction's memory operand (the products
      // are exact and the pair's sum symmetric: the order of the operands changes no bit).
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * xs + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xb);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xb);
    }
  }
  for (int j = 0; j < 4; ++j) {
    __mmask16 mask;
    __m512 b;
    if (!output_chunk(j, width, bias, mask, b)) break;
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
      _mm256_mask_storeu_epi16(y + r * ys + 16 * j, mask, (__m256i)out);
    }
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t,
                        int64_t);
// Rows per vdpbf16ps register tile: 7 x 4 accumulators + 4 weight vectors fill the 32 registers
// (x is broadcast from memory). One pass of up to 7 rows streams a panel at memory speed with
// its products in the shadow of the loads; each further row tile multiplies it again from L2. On
// one Zen 4 core, the default model's 30 layers, 3 alternating rounds (benchmarks/bf16_gemm.py)
// against 6-row tiles: 7 rows 9.3 vs 12.5 ms, 8 rows 11.7 vs 13.3, 9 rows 12.2 vs 14.1, 12 rows
// 15.5 vs 16.8, 16 rows 20.0 vs 20.7; from 24 rows to 1024 within noise.
constexpr int64_t kDotRows = 7;
constexpr TileFn kTiles[kDotRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>};

// tile<R>'s loop on CPUs with AVX-512F alone ("avx512f"), x widened to float32 beforehand
// (row stride xs floats): each 32-bit pair of the panel split into its two float32 values (a
// bf16 is a float's top half), the even K's then the odd K's fused multiply-added by x's
// broadcast: K summed in order one at a time, as the float32 GEMM sums it, so a quantized
// panel's results through that GEMM (kvsentry_f32::bf16_quant_gemm) are these bits.
template <int R>
__attribute__((target("avx512f"))) void tile_widen(const float* x, int64_t xs, const uint16_t* panel, int64_t pairs,
                                                   const float* bias, uint16_t* y, int64_t ys, int64_t width) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[R][4];
  zero(acc);
  const uint16_t* w = panel;
  for (int64_t p = 0; p < pairs; ++p, w += 2 * kPanel) {
    prefetch_pair_ahead(w);
    for (int j = 0; j < 4; ++j) {
      const __m512i wj = _mm512_loadu_si512(w + 32 * j);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(wj, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(wj, high));
      for (int r = 0; r < R; ++r) {
        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + 2 * p]), even, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + 2 * p + 1]), odd, acc[r][j]);
      }
    }
  }
  for (int j = 0; j < 4; ++j) {
    __mmask16 mask;
    __m512 b;
    if (!output_chunk(j, width, bias, mask, b)) break;
    for (int r = 0; r < R; ++r) {
      _mm256_mask_storeu_epi16(y + r * ys + 16 * j, mask, kvsentry_quant::to_bf16(_mm512_add_ps(acc[r][j], b)));
    }
  }
}

using WidenTileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t,
                             int64_t);
constexpr WidenTileFn kWidenTiles[kRows + 1] = {nullptr,       tile_widen<1>, tile_widen<2>, tile_widen<3>,
                                                tile_widen<4>, tile_widen<5>, tile_widen<6>};

// Tiles 0-3 are C (rows x 16 float32), 4 is A (rows x 32 bf16 of x), 5-7 are B (16 pairs x
// 16 outputs x 2 bf16), three of them so that loads run ahead of the products.
using kvsentry_amx::TileConfig;
TileConfig tile_config(int64_t rows) { return TileConfig({rows, rows, rows, rows, rows, kDepth, kDepth, kDepth}); }

constexpr int64_t kOutBytes = kPanel * 4;       // bytes per acc row: one panel's float32 outputs
constexpr int64_t kPairBytes = 2 * kPanel * 2;  // bytes per pair of K in a panel
constexpr int64_t kBlockBytes = kDepth * kPairBytes;

// Where amx_rows' blocks come from for a GGUF-quantized panel: each block of b0..b1 is
// dequantized into L1 right before its products, so the tiles' work on one block overlaps the
// dequantizing of the next. The blocks go to `dst` in turn, where later passes of rows read
// them, or to its first two blocks' room alternately (ping_pong: no later pass).
struct Dequant {
  const kvsentry_quant::Panels* quant;
  int64_t panel;
  uint16_t* dst;
  bool ping_pong;
};

// C [rows, 64] (+)= x[:, blocks b0..b1) . panel for the rows the loaded config was made for,
// the panel's blocks b0..b1 from `chunk` on (or dequantized as they go: `dequant`), starting
// from zero (first) or from `acc` [rows, 64] float32, and stored back to `acc`. With `ahead`
// set, each block also asks for `ahead_lines` cache lines from there into L2 (and advances
// it): the next chunk of the weight, while this pass runs out of L1.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"))) void amx_rows(
    const uint16_t* x, int64_t x_bytes, const uint16_t* chunk, int64_t b0, int64_t b1, bool first, float* acc,
    const char*& ahead, int64_t ahead_lines, const Dequant* dequant = nullptr) {
  kvsentry_bf16_amx::load_accumulators(first, acc, 16, kOutBytes);
  const char* a = reinterpret_cast<const char*>(x) + b0 * 4 * kDepth;
  for (int64_t b = b0; b < b1; ++b, a += 4 * kDepth) {
    const char* w = reinterpret_cast<const char*>(chunk) + (b - b0) * kBlockBytes;
    if (dequant != nullptr) {
      uint16_t* block = dequant->dst + (dequant->ping_pong ? b & 1 : b - b0) * (kBlockBytes / 2);
      kvsentry_quant::dequant_bf16(*dequant->quant, dequant->panel, b, b + 1, block);
      w = reinterpret_cast<const char*>(block);
    }
    kvsentry_bf16_amx::prefetch_chunk(ahead, ahead_lines);
    _tile_loadd(4, a, x_bytes);
    _tile_loadd(5, w, kPairBytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, w + 64, kPairBytes);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, w + 128, kPairBytes);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, w + 192, kPairBytes);
    _tile_dpbf16ps(3, 4, 5);
  }
  kvsentry_bf16_amx::store_accumulators(acc, 16, kOutBytes);
}

// y[r, 0:width] = bf16(acc[r, 0:width] + bias) for `rows` rows.
__attribute__((target("avx512f,avx512bf16"))) void amx_store(const float* acc, int64_t rows, const float* bias,
                                                             uint16_t* y, int64_t ys, int64_t width) {
  for (int j = 0; j < 4; ++j) {
    __mmask16 mask;
    __m512 bj;
    if (!output_chunk(j, width, bias, mask, bj)) break;
    for (int64_t r = 0; r < rows; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(acc + r * kPanel + 16 * j), bj));
      _mm256_mask_storeu_epi16(y + r * ys + 16 * j, mask, (__m256i)out);
    }
  }
}

// Panels [begin, end) for every row of x. Up to 16 rows walk a panel's K in one go (the panel
// streams from memory once). More rows walk it in chunks of kChunkBlocks blocks (24 KB of the
// panel, which stays in L1 across the blocks of rows), the C tiles kept in `acc` between
// chunks; and kAmxRowChunk rows at a time, their x staying in L2 across the panels.
// Tile state is per thread: configured here and released before returning.
__attribute__((target("amx-tile,amx-bf16"))) void amx_panels(int64_t begin, int64_t end, const uint16_t* xp,
                                                             int64_t xs, const uint16_t* wp, int64_t pairs,
                                                             const float* bp, uint16_t* yp, int64_t m,
                                                             int64_t n, const kvsentry_quant::Panels* quant) {
  float* acc = kvsentry_bf16_amx::accumulators(m);
  const int64_t blocks = pairs / kDepth, chunk = m <= kTileRows ? blocks : kChunkBlocks;
  alignas(64) uint16_t dequantized[kChunkBlocks * kBlockBytes / 2];
  // Bytes per block of what streams from memory: the panel's, or its GGUF blocks'.
  const int64_t stream_block = quant != nullptr ? kvsentry_quant::block_bytes(quant->type) : kBlockBytes;
  TileConfig loaded = tile_config(0);  // none yet: no config has 0 rows
  for (int64_t r0 = 0; r0 < m; r0 += kAmxRowChunk) {
    const int64_t r1 = std::min(m, r0 + kAmxRowChunk);
    for (int64_t panel = begin; panel < end; ++panel) {
      const uint16_t* w = quant != nullptr ? nullptr : wp + panel * pairs * 2 * kPanel;
      const char* stream = quant != nullptr ? reinterpret_cast<const char*>(quant->panel(panel))
                                            : reinterpret_cast<const char*>(w);
      const int64_t col = panel * kPanel;
      for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
        const int64_t b1 = std::min(blocks, b0 + chunk);
        // The next chunk lies right after this one (panels are contiguous): spread over the
        // later passes' blocks when there are kAheadPasses of them.
        const int64_t later = (r1 - r0 + kTileRows - 1) / kTileRows - 1;
        int64_t ahead_lines;
        const char* ahead = kvsentry_bf16_amx::chunk_ahead(stream, stream_block, b0, b1, later, ahead_lines);
        // GGUF-quantized: the first pass dequantizes the chunk (into L1) as it goes, for the others.
        const uint16_t* cw = quant != nullptr ? dequantized : w + b0 * kBlockBytes / 2;
        for (int64_t r = r0; r < r1; r += kTileRows) {
          kvsentry_bf16_amx::configure(loaded, tile_config(std::min(kTileRows, r1 - r)));
          const char* pass_ahead = r > r0 ? ahead : nullptr;  // the first pass streams this chunk
          const Dequant first_pass{quant, panel, dequantized, later == 0};
          amx_rows(xp + r * xs, xs * 2, cw, b0, b1, b0 == 0, acc + (r - r0) * kPanel, pass_ahead, ahead_lines,
                   quant != nullptr && r == r0 ? &first_pass : nullptr);
          if (pass_ahead != nullptr) ahead = pass_ahead;
        }
      }
      amx_store(acc, r1 - r0, bp != nullptr ? bp + col : nullptr, yp + r0 * n + col, n, std::min(kPanel, n - col));
    }
  }
  _tile_release();
}

// Threads split the panels; each walks its own (GGUF-quantized ones dequantized one at a time).
void amx_gemm(const uint16_t* xp, int64_t xs, const uint16_t* wp, int64_t panels, int64_t pairs, const float* bp,
              uint16_t* yp, int64_t m, int64_t n, const kvsentry_quant::Panels* quant) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    amx_panels(begin, end, xp, xs, wp, pairs, bp, yp, m, n, quant);
  });
}
#else
bool supported() { return false; }
#endif

Tensor pack(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "kvsentry::bf16_gemm_pack: weight must be a CPU bfloat16 [N, K] tensor");
  const Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel, pairs = padded_pairs(k);
  // Zero padding: past N the outputs are never stored, past K the products are 0 * 0 (x is
  // padded with zeros too).
  Tensor packed = at::zeros({panels, pairs, kPanel, 2}, w.options());
  kvsentry_panels::pack_panels(reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>()), n, k,
                               reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                               [pairs](int64_t panel, int64_t o, int64_t c) {
                                 return ((panel * pairs + c / 2) * kPanel + o) * 2 + c % 2;
                               });
  return packed;
}

enum class Kernel { kAmx, kAvx512Bf16, kAvx512F };

Kernel kernel_named(const std::string& name) {
  if (name == "amx") {
    TORCH_CHECK(kvsentry_amx::supported(), kOp, ": this CPU (or build) has no AMX-BF16");
    return Kernel::kAmx;
  }
  if (name == "avx512f") {
    TORCH_CHECK(kvsentry_f32::supported(), kOp, ": this CPU (or build) has no AVX-512F");
    return Kernel::kAvx512F;
  }
  TORCH_CHECK(name == "avx512_bf16", kOp, ": unknown kernel '", name, "' (amx, avx512_bf16 or avx512f)");
  TORCH_CHECK(supported(), kOp, ": this CPU (or build) has no AVX512-BF16");
  return Kernel::kAvx512Bf16;
}

Tensor run(const Tensor& x_in, const Tensor& packed, const std::optional<Tensor>& bias, int64_t n, Kernel kernel) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(), kOp,
              ": x must be a CPU bfloat16 [M, K] tensor");
  // The packed weight: bf16_gemm_pack's bf16 panels, or quant_panels_pack's GGUF blocks.
  const bool quant = packed.scalar_type() == at::kByte;
  // quant_rows_pack's rows layout: [panels, blocks, 80, 16] uint8, AMX only.
  const bool rows = kvsentry_quant::is_rows_layout(packed);
  TORCH_CHECK(!rows || kernel == Kernel::kAmx, kOp, ": the rows layout (quant_rows_pack) runs on the amx kernel only");
  TORCH_CHECK(rows || (quant ? packed.dim() == 3 && kvsentry_quant::type_of(packed.size(2)) >= 0 && packed.is_contiguous()
                             : packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == kPanel &&
                                   packed.size(3) == 2 && packed.is_contiguous()),
              kOp, ": packed must come from bf16_gemm_pack, quant_panels_pack or quant_rows_pack");
  const int64_t m = x_in.size(0), k = x_in.size(1), panels = packed.size(0);
  const int64_t pairs = quant ? packed.size(1) * kDepth : packed.size(1);
  TORCH_CHECK(pairs == padded_pairs(k) && n > (panels - 1) * kPanel && n <= panels * kPanel, kOp, ": x [", m, ", ",
              k, "] and N = ", n, " do not fit the packed weight ", packed.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, kOp, ": bias must be [N]");
  }
  Tensor y = at::empty({m, n}, x_in.options());
  if (m == 0) return y;
  // x as 32-bit pairs, rows contiguous and as long as the packed K (zeros past K): an AMX A
  // tile reads whole blocks of 32 values, which must not reach into the next row's values (a
  // NaN there times a zero weight would be NaN).
  Tensor x = x_in;
  if (2 * pairs != k || x.stride(1) != 1 || x.stride(0) % 2 != 0 || (reinterpret_cast<uintptr_t>(x.data_ptr()) & 3)) {
    x = at::zeros({m, 2 * pairs}, x_in.options());
    x.narrow(1, 0, k).copy_(x_in);
  }
  const Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : Tensor();
#if defined(__AVX512F__)
  const uint16_t* xh = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xh);
  const int64_t xs = x.stride(0) / 2;
  const uint16_t* wp = quant ? nullptr : reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  const auto qp = quant && !rows ? kvsentry_quant::Panels::of(packed.data_ptr<uint8_t>(), packed.size(1), packed.size(2))
                                 : kvsentry_quant::Panels{};
  const kvsentry_quant::Panels* q = quant ? &qp : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (rows) {
    TORCH_CHECK(kvsentry_quant::rows_supported(), kOp, ": the rows layout needs AVX512-VBMI, which this CPU lacks");
    const int64_t blocks = packed.size(1);
    const kvsentry_quant::Panels layout{packed.data_ptr<uint8_t>(), kvsentry_quant::kQ4_1, blocks,
                                        blocks * kvsentry_quant::kRowsBlockBytes};
    kvsentry_bf16_amx::amx_gemm_rows(xh, x.stride(0), panels, pairs, bp, yp, m, n, layout);
    return y;
  }
  if (kernel == Kernel::kAmx) {
    amx_gemm(xh, x.stride(0), wp, panels, pairs, bp, yp, m, n, q);
    return y;
  }
  if (kernel == Kernel::kAvx512F) {
    const Tensor xf = x.to(at::kFloat).contiguous();  // [m, 2 pairs]: exact, broadcast from memory
    if (q != nullptr) return y.copy_(kvsentry_f32::bf16_quant_gemm(xf, *q, panels, bp, n));  // RNE, as to_bf16
    const float* xfp = xf.data_ptr<float>();
    kvsentry_panels::for_row_tiles(
        m, panels, [&](int64_t panel) { return wp + panel * pairs * 2 * kPanel; },
        [&](const uint16_t* w, int64_t panel, int64_t r, int64_t rows) {
          const int64_t col = panel * kPanel;
          kWidenTiles[rows](xfp + r * 2 * pairs, 2 * pairs, w, pairs, bp != nullptr ? bp + col : nullptr,
                            yp + r * n + col, n, std::min(kPanel, n - col));
        });
    return y;
  }
  kvsentry_panels::for_row_tiles<kDotRows>(
      m, panels,
      [&](int64_t panel) { return q != nullptr ? kvsentry_quant::bf16_panel(*q, panel) : wp + panel * pairs * 2 * kPanel; },
      [&](const uint16_t* w, int64_t panel, int64_t r, int64_t rows) {
        const int64_t col = panel * kPanel;
        kTiles[rows](xp + r * xs, xs, w, pairs, bp != nullptr ? bp + col : nullptr, yp + r * n + col, n,
                     std::min(kPanel, n - col));
      });
#endif
  return y;
}

// The best kernel this CPU runs: AMX where there is AMX, else vdpbf16ps, else float32 FMAs.
Tensor gemm(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias, int64_t n) {
  TORCH_CHECK(supported() || kvsentry_f32::supported(), kOp, ": this CPU (or build) has no AVX-512F");
  return run(x, packed, bias, n,
             kvsentry_amx::supported() ? Kernel::kAmx : supported() ? Kernel::kAvx512Bf16 : Kernel::kAvx512F);
}

#ifdef KVSENTRY_DEBUG_OPS
Tensor gemm_with(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias, int64_t n,
                 c10::string_view kernel) {
  return run(x, packed, bias, n, kernel_named(std::string(kernel)));
}
#endif

bool gemm_supported() { return supported() || kvsentry_f32::supported(); }

std::vector<std::string> gemm_kernels() {
  std::vector<std::string> kernels;
  if (kvsentry_amx::supported()) kernels.emplace_back("amx");
  if (supported()) kernels.emplace_back("avx512_bf16");
  if (kvsentry_f32::supported()) kernels.emplace_back("avx512f");
  return kernels;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("bf16_gemm_pack(Tensor weight) -> Tensor");
  m.def("bf16_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("bf16_gemm_supported() -> bool", &gemm_supported);
  m.def("bf16_gemm_kernels() -> str[]", &gemm_kernels);
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) {
  m.impl("bf16_gemm_pack", &pack);
  m.impl("bf16_gemm", &gemm);
}

#ifdef KVSENTRY_DEBUG_OPS
// One kernel by name (tests and benchmarks/bf16_gemm.py hold each to the others).
TORCH_LIBRARY_FRAGMENT(kvsentry_debug, m) {
  m.def("bf16_gemm_with(Tensor x, Tensor packed, Tensor? bias, int n, str kernel) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvsentry_debug, CPU, m) { m.impl("bf16_gemm_with", &gemm_with); }
#endif
