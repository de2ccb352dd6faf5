// The bf16 GEMM (cpu_bf16_gemm.cpp) on a GGUF checkpoint's Q4_1 blocks in the rows layout
// (cpu_quant_panels.h, quant_rows_pack), on AMX tiles with the weight as their A operand.
//
// The same products summed in the same order, the operands' roles swapped: C^T = W . x^T, C a
// tile of 16 outputs x up to 16 rows of x, A a block's 16 outputs x 32 K straight from the rows
// layout's lookups, B 16 pairs of K x the tile's rows of x, laid out once per call (xt). The
// tiles' sums do not depend on which operand is which (checked bit for bit against the panels,
// tests/csrc/test_quant_panels.py), so a row gets the panels' bits. Why: those lookups
// dequantize a block in ~5 vector instructions per output where the panel layout takes ~9, and a
// decode step of one request is bound by that (the default model's 30 layers at one row: see
// docs/kernels.md). Tiles 0-3 are C, 4-5 A (alternating), 6-7 B (by the block's parity).
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "cpu_amx.h"
#include "cpu_bf16_amx.h"
#include "cpu_panel_gemm.h"
#include "cpu_prefetch.h"
#include "cpu_quant_panels.h"

namespace kvsentry_bf16_amx {
#if defined(__AVX512F__)
namespace {

using kvsentry_amx::TileConfig;
using kvsentry_panels::kPanel;
using kvsentry_panels::output_chunk;

constexpr int64_t kRowsBlockHalves = kvsentry_quant::kOutputs * kvsentry_quant::kBlockK;  // bf16 of a dequantized block
TileConfig rows_tile_config(int64_t rows) {
  const int64_t bytes = 4 * rows;
  return TileConfig({kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kDepth, kDepth},
                    {bytes, bytes, bytes, bytes, 64, 64, bytes, bytes});
}

// The row stride of x^T's B tiles for a tile of `rows` rows: their 4-byte pairs, padded to a
// power of two so that no tile row straddles a cache line.
int64_t xt_stride(int64_t rows) {
  int64_t padded = 1;
  while (padded < rows) padded *= 2;
  return 4 * padded;
}

// r[i] = column i of the 16 x 16 matrix of 32-bit lanes whose row i was r[i].
__attribute__((target("avx512f"), always_inline)) inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + 4 + i], 0x88);
      t[h + 4 + i] = _mm512_shuffle_i32x4(r[h + i], r[h + 4 + i], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
  }
}

// x [m, 2 pairs] bf16 (row stride xs) as B tiles: row tile t at xt + t * pairs * 16 (32-bit
// pairs), in it pair p of its row r at p * stride / 4 + r; 16 pairs of 16 rows at a time,
// transposed in registers.
__attribute__((target("avx512f"))) void lay_out_xt(const uint32_t* x, int64_t xs, int64_t m, int64_t pairs,
                                                   uint32_t* xt) {
  for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, m - r0), step = xt_stride(rows) / 4;
    const __mmask16 keep = static_cast<__mmask16>((1u << step) - 1);
    uint32_t* tile = xt + r0 / kTileRows * pairs * kTileRows;
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {  // pairs: whole blocks of 16
      __m512i v[16];
      for (int r = 0; r < 16; ++r) {
        v[r] = r < rows ? _mm512_loadu_si512(x + (r0 + r) * xs + p0) : _mm512_setzero_si512();
      }
      transpose16(v);
      for (int p = 0; p < 16; ++p) _mm512_mask_storeu_epi32(tile + (p0 + p) * step, keep, v[p]);
    }
  }
}

// Block b's tiles for group g of outputs (g 0 also loads x^T's B tile), run between the next
// block's lookups (dequant_rows' `between`): each tile load then finds the product before it that
// read the same A tile done, where back to back they queue behind the products and hold up the
// lookups behind them.
struct RowsTiles {
  const uint16_t* a;
  const char* xt;
  int64_t stride;
  bool odd;
  __attribute__((target("amx-tile,amx-bf16"), always_inline)) inline void operator()(int g) const {
    if (odd) {
      if (g == 0) _tile_loadd(7, xt, stride);
      if (g == 0) { _tile_loadd(4, a, 64); _tile_dpbf16ps(0, 4, 7); }
      if (g == 1) { _tile_loadd(5, a + 16 * 32, 64); _tile_dpbf16ps(1, 5, 7); }
      if (g == 2) { _tile_loadd(4, a + 32 * 32, 64); _tile_dpbf16ps(2, 4, 7); }
      if (g == 3) { _tile_loadd(5, a + 48 * 32, 64); _tile_dpbf16ps(3, 5, 7); }
    } else {
      if (g == 0) _tile_loadd(6, xt, stride);
      if (g == 0) { _tile_loadd(4, a, 64); _tile_dpbf16ps(0, 4, 6); }
      if (g == 1) { _tile_loadd(5, a + 16 * 32, 64); _tile_dpbf16ps(1, 5, 6); }
      if (g == 2) { _tile_loadd(4, a + 32 * 32, 64); _tile_dpbf16ps(2, 4, 6); }
      if (g == 3) { _tile_loadd(5, a + 48 * 32, 64); _tile_dpbf16ps(3, 5, 6); }
    }
  }
};

// C^T [64 outputs, rows] (+)= panel blocks b0..b1 . x^T for one tile of rows (config loaded),
// as amx_rows does it for the panel layout: from zero (first) or from acc ([64][16] float32),
// stored back to acc; compact (a tile of one row): acc is [64] float32, the row's outputs in
// order. The blocks lie dequantized in `chunk` ([blocks][64][32] bf16), or, with
// `src` (the rows layout's blocks b0..b1), are looked up into it as the pass goes: in turn, or
// into its first two blocks' room alternately (ping_pong: no later pass reads them). Block b's
// tiles then run between block b + 1's lookups: tileloadd reads only what has left the store
// buffer, which block b's lookups have by then, and tile and vector work overlap.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vbmi,avx512bf16,f16c"))) void amx_rows_pass(
    const char* xt, int64_t stride, uint16_t* chunk, int64_t b0, int64_t b1, bool first, float* acc, bool compact,
    const char*& ahead, int64_t ahead_lines, const uint8_t* src, bool ping_pong) {
  const int64_t acc_step = compact ? kTileRows : 256, acc_stride = compact ? 4 : 64;
  load_accumulators(first, acc, acc_step, acc_stride);
  auto slot = [&](int64_t b) { return chunk + (src != nullptr && ping_pong ? b & 1 : b - b0) * kRowsBlockHalves; };
  if (src != nullptr && b0 < b1) kvsentry_quant::dequant_rows(src, slot(b0));
  for (int64_t b = b0; b < b1; ++b) {
    prefetch_chunk(ahead, ahead_lines);
    const RowsTiles tiles{slot(b), xt + b * kDepth * stride, stride, (b & 1) != 0};
    if (src != nullptr && b + 1 < b1) {
      kvsentry_quant::dequant_rows(src + (b + 1 - b0) * kvsentry_quant::kRowsBlockBytes, slot(b + 1), tiles);
    } else {
      for (int g = 0; g < 4; ++g) tiles(g);
    }
  }
  store_accumulators(acc, acc_step, acc_stride);
}

// A tile of one row keeps its accumulators compact: [64] float32, its outputs in order.
inline bool compact(int64_t rows) { return rows == 1; }

// y[r, 0:width] = bf16(C^T[0:width, r] + bias) for `rows` rows of one tile's acc ([64][16],
// 16 outputs at a time transposed in registers; [64] for one row, amx_rows_pass' compact).
__attribute__((target("avx512f,avx512bf16"))) void amx_rows_store(const float* acc, int64_t rows,
                                                                  const float* bias, uint16_t* y, int64_t ys,
                                                                  int64_t width) {
  for (int j = 0; j < 4; ++j) {
    __mmask16 mask;
    __m512 bj;
    if (!output_chunk(j, width, bias, mask, bj)) break;
    if (compact(rows)) {  // nothing to transpose
      const __m512 out = _mm512_add_ps(_mm512_load_ps(acc + 16 * j), bj);
      _mm256_mask_storeu_epi16(y + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(out));
      continue;
    }
    __m512i v[16];
    for (int i = 0; i < 16; ++i) v[i] = _mm512_load_si512(acc + 256 * j + 16 * i);
    transpose16(v);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 out = _mm512_add_ps(_mm512_castsi512_ps(v[r]), bj);
      _mm256_mask_storeu_epi16(y + r * ys + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}

// Panels [begin, end) for every row of x, walked as amx_panels walks them (the whole K per pass
// up to 16 rows; chunks of kChunkBlocks blocks beyond, which the first pass dequantizes into L1
// for the others and the later passes bring the next chunk into L2 from kAheadPasses).
__attribute__((target("amx-tile,amx-bf16"))) void amx_panels_rows(int64_t begin, int64_t end, const uint32_t* xt,
                                                                  int64_t pairs, const float* bp, uint16_t* yp,
                                                                  int64_t m, int64_t n,
                                                                  const kvsentry_quant::Panels& quant) {
  float* acc = accumulators(m);
  const int64_t blocks = pairs / kDepth, chunk = m <= kTileRows ? blocks : kChunkBlocks;
  alignas(64) uint16_t dequantized[kChunkBlocks * kRowsBlockHalves];  // written before read: no zeroing
  const int64_t stream_block = kvsentry_quant::kRowsBlockBytes;
  TileConfig loaded = rows_tile_config(0);  // none yet: no call has 0 rows
  for (int64_t r0 = 0; r0 < m; r0 += kAmxRowChunk) {
    const int64_t r1 = std::min(m, r0 + kAmxRowChunk);
    auto tile_acc = [&](int64_t r) { return acc + (r - r0) / kTileRows * kvsentry_quant::kOutputs * kTileRows; };
    for (int64_t panel = begin; panel < end; ++panel) {
      const uint8_t* stream = quant.panel(panel);
      const int64_t col = panel * kPanel;
      for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
        const int64_t b1 = std::min(blocks, b0 + chunk);
        const int64_t later = (r1 - r0 + kTileRows - 1) / kTileRows - 1;
        int64_t ahead_lines;
        const char* ahead =
            chunk_ahead(reinterpret_cast<const char*>(stream), stream_block, b0, b1, later, ahead_lines);
        for (int64_t r = r0; r < r1; r += kTileRows) {
          const int64_t rows = std::min(kTileRows, r1 - r);
          configure(loaded, rows_tile_config(rows));
          const char* pass_ahead = r > r0 ? ahead : nullptr;  // the first pass streams this chunk
          const char* xt_tile = reinterpret_cast<const char*>(xt + r / kTileRows * pairs * kTileRows);
          // The first pass looks the chunk's blocks up (into L1) as it goes, for the others.
          amx_rows_pass(xt_tile, xt_stride(rows), dequantized, b0, b1, b0 == 0, tile_acc(r), compact(rows), pass_ahead,
                        ahead_lines, r == r0 ? stream + b0 * stream_block : nullptr, later == 0);
          if (pass_ahead != nullptr) ahead = pass_ahead;
        }
      }
      for (int64_t r = r0; r < r1; r += kTileRows) {
        amx_rows_store(tile_acc(r), std::min(kTileRows, r1 - r), bp != nullptr ? bp + col : nullptr, yp + r * n + col,
                       n, std::min(kPanel, n - col));
      }
    }
  }
  _tile_release();
}

}  // namespace

void amx_gemm_rows(const uint16_t* xh, int64_t xs, int64_t panels, int64_t pairs, const float* bp, uint16_t* yp,
                   int64_t m, int64_t n, const kvsentry_quant::Panels& quant) {
  // One row's x^T is the row itself: its pairs in order, 4 bytes apart (xt_stride(1)); a
  // decode step of one request then lays nothing out.
  const uint32_t* row = reinterpret_cast<const uint32_t*>(xh);
  std::unique_ptr<uint32_t, decltype(&std::free)> xt(nullptr, &std::free);
  if (m > 1) {
    // Every word a tile reads is written by lay_out_xt (zeros past m): no zeroing.
    const size_t words = static_cast<size_t>((m + kTileRows - 1) / kTileRows * kTileRows * pairs);
    xt.reset(static_cast<uint32_t*>(std::aligned_alloc(64, (words * 4 + 63) / 64 * 64)));
    TORCH_CHECK(xt != nullptr, "kvsentry::bf16_gemm: out of memory for x^T");
    lay_out_xt(row, xs / 2, m, pairs, xt.get());
  }
  const uint32_t* xt_rows = m > 1 ? xt.get() : row;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    amx_panels_rows(begin, end, xt_rows, pairs, bp, yp, m, n, quant);
  });
}

#else
void amx_gemm_rows(const uint16_t*, int64_t, int64_t, int64_t, const float*, uint16_t*, int64_t, int64_t,
                   const kvsentry_quant::Panels&) {}  // builds below AVX-512 never call it
#endif
}  // namespace kvsentry_bf16_amx
