// What the two panel GEMMs (cpu_bf16_gemm.cpp, cpu_f32_gemm.cpp) share: the panel and row
// tile sizes, the packing loop, the epilogue's store mask and bias, and the walk of row tiles
// over the panels.
#pragma once

#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace kvsentry_panels {

constexpr int64_t kPanel = 64;  // outputs per panel: 4 vectors of 16 float32 accumulators
constexpr int64_t kRows = 6;    // rows per register tile: 6 x 4 accumulators + 4 weight vectors
constexpr int64_t kChunk = 96;  // rows per pass over the panels: their x stays in L2

// tile(w, panel, row, rows): rows [row, row + rows) of x (rows <= Rows, the caller's row tile:
// kRows, or the bf16 kernel's kDotRows) against one panel,
// whose weights panel_at(panel) gives (the packed panel, or a dequantized copy of it). Threads
// split the panels; each walks its panels once per chunk of rows, so a panel streams from
// memory once per chunk and stays in L2 across its row tiles.
template <int64_t Rows = kRows, typename PanelAt, typename Tile>
void for_row_tiles(int64_t m, int64_t panels, const PanelAt& panel_at, const Tile& tile) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kChunk) {
      const int64_t r1 = std::min(m, r0 + kChunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        const auto* w = panel_at(panel);
        for (int64_t r = r0; r < r1; r += Rows) tile(w, panel, r, std::min(Rows, r1 - r));
      }
    }
  });
}

// Packing: out[place(panel, o, c)] = w[panel * kPanel + o][c] for each of the weight's n rows
// of k values ([n, k] contiguous), threads over panels; the rest of out (zeros) is padding.
template <typename T, typename Place>
void pack_panels(const T* w, int64_t n, int64_t k, T* out, const Place& place) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t o = 0; o < kPanel && panel * kPanel + o < n; ++o) {
        const T* row = w + (panel * kPanel + o) * k;
        for (int64_t c = 0; c < k; ++c) out[place(panel, o, c)] = row[c];
      }
    }
  });
}

#if defined(__AVX512F__)
// Output chunk j (16 columns) of a panel with `width` valid outputs: the store mask and the
// bias (0 without one); false when the chunk lies past the width. Every kernel's epilogue.
__attribute__((target("avx512f"))) inline bool output_chunk(int j, int64_t width, const float* bias,
                                                            __mmask16& mask, __m512& b) {
  const int64_t left = width - 16 * j;
  if (left <= 0) return false;
  mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
  return true;
}
#endif

}  // namespace kvsentry_panels
