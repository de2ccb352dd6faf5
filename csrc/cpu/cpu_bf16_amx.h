// What the bf16 GEMM's two AMX paths share (cpu_bf16_gemm.cpp: the panel layout, x as the tiles'
// A operand; cpu_bf16_gemm_rows.cpp: Q4_1 blocks in the rows layout, the weight as A): how they
// walk a panel, and the rows layout's entry point.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_amx.h"
#include "cpu_prefetch.h"
#include "cpu_quant_panels.h"

namespace kvsentry_bf16_amx {

constexpr int64_t kDepth = 16;     // pairs of K per AMX tile (and the packing's K granule)
constexpr int64_t kTileRows = 16;  // rows of x per AMX tile
constexpr int64_t kChunkBlocks = 6;    // blocks of K per pass over a panel for more than 16 rows
// Passes over a chunk after the first (which streams it from memory; the others read it from
// L1) from which those later passes also bring the next chunk into L2: 3, i.e. 49-64 rows.
// There the prefetches spread thin enough (~21 lines a block) to run beside the tiles: the
// default model's 30 layers at 64 rows 23.9 -> 21.0 ms, its decode step at batch 64 69.1-71.2
// -> 65.1-66.4 ms (1-core Xeon, weights on huge pages, alternating). With one or two later
// passes (17-48 rows) the same prefetches measured no faster.
constexpr int64_t kAheadPasses = 3;
constexpr int64_t kAmxRowChunk = 256;  // rows per pass over the panels: their x stays in L2

#if defined(__AVX512F__)
// C tiles 0-3 (a panel's 64 outputs) from zero (first) or loaded from acc + i * step floats, rows
// `stride` bytes apart; and stored back there.
__attribute__((target("amx-tile"), always_inline)) inline void load_accumulators(bool first, float* acc, int64_t step,
                                                                                 int64_t stride) {
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, acc, stride);
    _tile_loadd(1, acc + step, stride);
    _tile_loadd(2, acc + 2 * step, stride);
    _tile_loadd(3, acc + 3 * step, stride);
  }
}

// Loads `want` unless it is the config loaded (ldtilecfg also zeroes the tiles).
__attribute__((target("amx-tile"), always_inline)) inline void configure(kvsentry_amx::TileConfig& loaded,
                                                                         const kvsentry_amx::TileConfig& want) {
  if (std::memcmp(&want, &loaded, sizeof want) != 0) {
    loaded = want;
    _tile_loadconfig(&loaded);
  }
}
#endif

// The C tiles' float32 room for a call of m rows: kAmxRowChunk rows of them at most, 64 outputs
// ([16][64] for the panel layout, [64][16] for the rows layout) per tile of kTileRows rows. Every
// float is written (a tile stored from zero on the first pass) before it is read, so the buffer is
// this thread's, kept across calls and never zeroed.
inline float* accumulators(int64_t m) {
  thread_local kvsentry_amx::TileBuffer<float> buffer;
  const int64_t tiles = (std::min(m, kAmxRowChunk) + kTileRows - 1) / kTileRows;
  const size_t floats = static_cast<size_t>(tiles * kTileRows * kvsentry_panels::kPanel);
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

// Where the later passes over a chunk of blocks b0..b1 prefetch the next chunk into L2 from (it
// lies right after, panels being contiguous: `stream` a panel's first byte, `bytes` a block's),
// spread over their blocks, `lines` a block; nullptr with fewer than kAheadPasses later passes.
inline const char* chunk_ahead(const char* stream, int64_t bytes, int64_t b0, int64_t b1, int64_t later,
                               int64_t& lines) {
  lines = 0;
  if (later < kAheadPasses) return nullptr;
  lines = ((b1 - b0) * bytes / 64 + later * (b1 - b0) - 1) / (later * (b1 - b0));
  return stream + b1 * bytes;
}

// A block's share of that prefetch: `lines` lines from `ahead` on into L2 (and past them), where set.
inline void prefetch_chunk(const char*& ahead, int64_t lines) {
  if (ahead == nullptr) return;
  for (int64_t i = 0; i < lines; ++i, ahead += 64) kvsentry_mem::prefetch_l2(ahead);
}

#if defined(__AVX512F__)
__attribute__((target("amx-tile"), always_inline)) inline void store_accumulators(float* acc, int64_t step,
                                                                                  int64_t stride) {
  _tile_stored(0, acc, stride);
  _tile_stored(1, acc + step, stride);
  _tile_stored(2, acc + 2 * step, stride);
  _tile_stored(3, acc + 3 * step, stride);
}
#endif

// y [m, n] bf16 (row stride n) = x [m, 2 pairs] bf16 (row stride xs elements) . W^T (+ bias [n]
// float32, or nullptr), W the `panels` panels of Q4_1 blocks in the rows layout (quant_rows_pack),
// on AMX tiles: the bits of the panel layout's tiles. Needs AMX-BF16 and rows_supported().
void amx_gemm_rows(const uint16_t* x, int64_t xs, int64_t panels, int64_t pairs, const float* bias, uint16_t* y,
                   int64_t m, int64_t n, const kvsentry_quant::Panels& quant);

}  // namespace kvsentry_bf16_amx
