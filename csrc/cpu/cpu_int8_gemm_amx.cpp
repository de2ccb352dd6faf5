// The int8-activation GEMM of GGUF blocks on AMX-INT8 tiles, for the batches where the AVX512-VNNI
// kernel (cpu_int8_gemm.cpp, which quantizes the activations and calls this) falls behind: the
// same packed blocks, the same bits (engine/models/int8_reference.py's arithmetic, in its order).
//
//   torch.ops.kvsentry.int8_gemm_kernels() -> str[]   the kernels int8_gemm runs on this CPU, best
//            first: "amx_int8" (this file, from amx_min_rows() rows of Q4_0 / Q4_1 / Q8_0) and
//            "avx512_vnni" (every other call); the registry's label names them
//   torch.ops.kvsentry_debug.int8_gemm_amx_rows(int? min_rows) -> int   the test build's switch:
//            the fewest rows the AMX path takes (set it past any batch to run VNNI alone)
//
// Why: the VNNI kernel spends 8 vpdpbusd per row, block of 32 K and 16 outputs on the integer
// sums alone, and the same again on their float32 scaling; from 8 rows up the bf16 AMX panels on
// the same blocks beat it (0.82x at 8 rows, 0.36x at 64). Here one tdpbssd takes a block's sums
// for 16 rows x 16 outputs, and the vector units do only the scaling the reference prescribes.
//
// Per pair of packed groups (32 outputs) and chunk of kChunk blocks of K:
//   unpack  each group's block into a B tile of 8 rows x 64 bytes: byte 4r + j of row c is the
//           weight of output r at K = 4c + j, as the packed vectors already lie (their header):
//           Q4_0 / Q4_1 vector c gives row c (low nibbles) and row 4 + c (high nibbles), Q4_0
//           less 8; Q8_0's 8 vectors less their 128. All signed bytes (a Q4_1 nibble is 0-15).
//   sums    per 32 rows (two A tiles of 16 rows x 32 bytes, the quantized activations as they
//           lie) and block, 4 C tiles of int32 = A . B (tdpbssd: exact), stored for the scaling;
//   scale   per row and output, block by block in K's order: acc + (dw * dx) * isum (Q4_1:
//           + mw * sx), each product and sum rounded on its own (the *_round_ps intrinsics keep
//           GCC from fusing them), from 0 at the first block, + bias after the last.
// So a row's bits are the VNNI kernel's, whichever path its batch takes (tests/csrc/test_int8_gemm.py).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu_amx.h"
#include "cpu_int8_gemm_amx.h"

namespace kvsentry_int8 {
namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML type ids
constexpr int64_t kGroup = 16;                       // outputs per packed group: one C tile's columns
constexpr int64_t kTileRows = 16;                    // batch rows per A tile
constexpr int64_t kRowTile = 2 * kTileRows;          // batch rows per pass: two A tiles
constexpr int64_t kChunk = 4;                        // blocks of K whose sums wait in L1 for the scaling
constexpr int64_t kTileInts = kTileRows * kGroup;    // int32 per C tile
constexpr int64_t kBTileBytes = 8 * 64;              // one block of one group: 8 rows of 4 K x 16 outputs
constexpr int64_t kAhead = 2;                        // chunks of each group's blocks prefetched ahead
// Fewest rows the AMX path takes: see docs/kernels.md for the measurement.
constexpr int64_t kMinRows = 8;

// cpu_int8_gemm.cpp's packed block: 16 float16 scales (Q4_1: then 16 minima), then the quants.
constexpr int64_t scale_bytes(int64_t type) { return type == kQ4_1 ? 4 * kGroup : 2 * kGroup; }
constexpr int64_t packed_bytes(int64_t type) { return scale_bytes(type) + 64 * (type == kQ8_0 ? 8 : 4); }

#ifdef KVSENTRY_DEBUG_OPS
std::atomic<int64_t> g_min_rows{kMinRows};
int64_t min_rows() { return g_min_rows.load(std::memory_order_relaxed); }
int64_t amx_rows(std::optional<int64_t> rows) {
  if (rows.has_value()) g_min_rows.store(*rows);
  return min_rows();
}
#else
constexpr int64_t min_rows() { return kMinRows; }
#endif

#if defined(__AVX512F__)
#define KVS_AMX_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c,amx-tile,amx-int8")))
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// One pair of groups' chunk of blocks, unpacked: B tiles and float32 scales.
struct Chunk {
  alignas(64) int8_t quants[kChunk][2][kBTileBytes];
  alignas(64) float dw[kChunk][2][kGroup];
  alignas(64) float mw[kChunk][2][kGroup];
};

// Tiles 0-3 are C (2 a + g: A tile a, group g; 16 rows of 16 int32), 4-5 A (16 rows x 32 bytes of
// quantized activations), 6-7 B (group g: 8 rows x 64 bytes).
kvsentry_amx::TileConfig tile_config() {
  return kvsentry_amx::TileConfig({16, 16, 16, 16, 16, 16, 8, 8}, {64, 64, 64, 64, 32, 32, 64, 64});
}

template <int64_t kType>
KVS_AMX_INT8_TARGET void unpack(const uint8_t* block, int8_t* quants, float* dw, float* mw) {
  _mm512_store_ps(dw, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block))));
  if (kType == kQ4_1) {
    _mm512_store_ps(mw, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32))));
  }
  const uint8_t* q = block + scale_bytes(kType);
  if (kType == kQ8_0) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    #pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) _mm512_store_si512(quants + 64 * c, _mm512_xor_si512(_mm512_loadu_si512(q + 64 * c), bias));
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  #pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(q + 64 * c);
    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if (kType == kQ4_0) {
      lo = _mm512_sub_epi8(lo, eight);
      hi = _mm512_sub_epi8(hi, eight);
    }
    _mm512_store_si512(quants + 64 * c, lo);
    _mm512_store_si512(quants + 64 * (4 + c), hi);
  }
}

// isum[b][2 a + g] [16 rows][16 outputs] int32 for the chunk's blocks b < kc: A tile a holds rows
// a0 + 16 a (a < A), group g < G. The first row's quants for the chunk start at `x`.
template <int A, int G>
KVS_AMX_INT8_TARGET void products(const int8_t* x, int64_t k, int64_t kc, const Chunk& w, int32_t* isum) {
  for (int64_t b = 0; b < kc; ++b, x += 32, isum += 4 * kTileInts) {
    _tile_zero(0);
    if (G == 2) _tile_zero(1);
    if (A == 2) _tile_zero(2);
    if (A == 2 && G == 2) _tile_zero(3);
    _tile_loadd(4, x, k);
    _tile_loadd(6, w.quants[b][0], 64);
    _tile_dpbssd(0, 4, 6);
    if (G == 2) {
      _tile_loadd(7, w.quants[b][1], 64);
      _tile_dpbssd(1, 4, 7);
    }
    if (A == 2) {
      _tile_loadd(5, x + kTileRows * k, k);
      _tile_dpbssd(2, 5, 6);
      if (G == 2) _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, isum, 64);
    if (G == 2) _tile_stored(1, isum + kTileInts, 64);
    if (A == 2) _tile_stored(2, isum + 2 * kTileInts, 64);
    if (A == 2 && G == 2) _tile_stored(3, isum + 3 * kTileInts, 64);
  }
}

// Where the scaling of rows [r0, r0 + rows) reads and writes.
struct Rows {
  int64_t r0, rows;
  const float* dx;  // [m, blocks]: row r's block b at dx[r * blocks + b]
  const float* sx;
  int64_t blocks, b0;
  bool first, last;
  float* acc;        // [m, 32] float32: the pair's partial sums between chunks
  const float* bias; // the pair's [32] (nullptr: none)
  float* y;          // the pair's first output of row 0; rows n apart
  int64_t n;
  int valid;         // outputs of the pair that exist (1-32)
};

// acc[r][g] (+)= sum over the chunk's KC blocks, in order, of (dw * dx) * isum (Q4_1: + mw * sx);
// after the last chunk, + bias and stored to y.
template <int64_t kType, int G, int KC>
KVS_AMX_INT8_TARGET void scale(const int32_t* isum, const Chunk& w, const Rows& span) {
  __m512 dw[KC][G], mw[KC][G];
  #pragma GCC unroll 8
  for (int b = 0; b < KC; ++b) {
    #pragma GCC unroll 2
    for (int g = 0; g < G; ++g) {
      dw[b][g] = _mm512_load_ps(w.dw[b][g]);
      if (kType == kQ4_1) mw[b][g] = _mm512_load_ps(w.mw[b][g]);
    }
  }
  for (int64_t i = 0; i < span.rows; ++i) {
    const int64_t row = span.r0 + i;
    const int32_t* sums = isum + (i / kTileRows) * 2 * kTileInts + (i % kTileRows) * kGroup;
    const float* dx = span.dx + row * span.blocks + span.b0;
    const float* sx = span.sx + row * span.blocks + span.b0;
    float* acc = span.acc + row * 2 * kGroup;
    __m512 a[G];
    #pragma GCC unroll 2
    for (int g = 0; g < G; ++g) a[g] = span.first ? _mm512_setzero_ps() : _mm512_load_ps(acc + kGroup * g);
    #pragma GCC unroll 8
    for (int b = 0; b < KC; ++b) {
      const __m512 xd = _mm512_set1_ps(dx[b]);
      const __m512 xs = kType == kQ4_1 ? _mm512_set1_ps(sx[b]) : xd;
      #pragma GCC unroll 2
      for (int g = 0; g < G; ++g) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(sums + b * 4 * kTileInts + g * kTileInts));
        __m512 term = _mm512_mul_round_ps(_mm512_mul_round_ps(dw[b][g], xd, kRound), dot, kRound);
        if (kType == kQ4_1) term = _mm512_add_round_ps(term, _mm512_mul_round_ps(mw[b][g], xs, kRound), kRound);
        a[g] = _mm512_add_round_ps(a[g], term, kRound);
      }
    }
    #pragma GCC unroll 2
    for (int g = 0; g < G; ++g) {
      if (!span.last) {
        _mm512_store_ps(acc + kGroup * g, a[g]);
        continue;
      }
      const int lanes = std::min(span.valid - 16 * g, 16);
      const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
      if (span.bias != nullptr) a[g] = _mm512_add_round_ps(a[g], _mm512_maskz_loadu_ps(mask, span.bias + 16 * g), kRound);
      _mm512_mask_storeu_ps(span.y + row * span.n + 16 * g, mask, a[g]);
    }
  }
}

template <int64_t kType, int G>
KVS_AMX_INT8_TARGET void scale_chunk(const int32_t* isum, const Chunk& w, const Rows& span, int64_t kc) {
  switch (kc) {
    case 4: scale<kType, G, 4>(isum, w, span); break;
    case 3: scale<kType, G, 3>(isum, w, span); break;
    case 2: scale<kType, G, 2>(isum, w, span); break;
    default: scale<kType, G, 1>(isum, w, span); break;
  }
}
static_assert(kChunk == 4, "scale_chunk instantiates 1 to kChunk blocks");

template <int G>
KVS_AMX_INT8_TARGET void products_rows(const int8_t* x, int64_t k, int64_t rows, int64_t kc, const Chunk& w,
                                       int32_t* isum) {
  if (rows > kTileRows) {
    products<2, G>(x, k, kc, w, isum);
  } else {
    products<1, G>(x, k, kc, w, isum);
  }
}

// Pairs of groups [begin, end) for all m rows. Tile state is per thread: configured here and
// released before returning.
template <int64_t kType>
KVS_AMX_INT8_TARGET void pairs(int64_t begin, int64_t end, const uint8_t* packed, int64_t groups, int64_t blocks,
                               const int8_t* q, const float* dx, const float* sx, int64_t m, const float* bias,
                               float* y, int64_t n) {
  const kvsentry_amx::TileConfig config = tile_config();
  _tile_loadconfig(&config);
  const int64_t k = blocks * 32, bytes = packed_bytes(kType);
  Chunk w;
  kvsentry_amx::TileBuffer<int32_t> isum(static_cast<size_t>(kChunk * 4 * kTileInts));
  kvsentry_amx::TileBuffer<float> acc(blocks > kChunk ? static_cast<size_t>(m * 2 * kGroup) : 0);
  for (int64_t p = begin; p < end; ++p) {
    const int G = 2 * p + 1 < groups ? 2 : 1;
    const int64_t n0 = 2 * p * kGroup;
    for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
      const int64_t kc = std::min(kChunk, blocks - b0);
      for (int g = 0; g < G; ++g) {
        const uint8_t* group = packed + ((2 * p + g) * blocks + b0) * bytes;
        for (int64_t b = 0; b < kc; ++b) unpack<kType>(group + b * bytes, w.quants[b][g], w.dw[b][g], w.mw[b][g]);
        // Each group's blocks kAhead chunks on (past its end: the next group's, next here too)
        // into L1 while these multiply: the hardware prefetcher lags this bursty stream.
        const char* ahead = reinterpret_cast<const char*>(group) + kAhead * kChunk * bytes;
        for (int64_t line = 0; line < kc * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
      for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
        const int64_t rows = std::min(kRowTile, m - r0);
        const Rows span{r0, rows, dx, sx, blocks, b0, b0 == 0, b0 + kc == blocks, acc.data(),
                      bias != nullptr ? bias + n0 : nullptr, y + n0, n,
                      static_cast<int>(std::min<int64_t>(2 * kGroup, n - n0))};
        const int8_t* x = q + r0 * k + 32 * b0;
        if (G == 2) {
          products_rows<2>(x, k, rows, kc, w, isum.data());
          scale_chunk<kType, 2>(isum.data(), w, span, kc);
        } else {
          products_rows<1>(x, k, rows, kc, w, isum.data());
          scale_chunk<kType, 1>(isum.data(), w, span, kc);
        }
      }
    }
  }
  _tile_release();
}

bool cpu_runs() { return kvsentry_amx::int8_supported(); }
#else
bool cpu_runs() { return false; }
#endif

bool vnni_runs() {
#if defined(__AVX512F__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

std::vector<std::string> kernels() {
  std::vector<std::string> names;
  if (cpu_runs()) names.emplace_back("amx_int8");
  if (vnni_runs()) names.emplace_back("avx512_vnni");
  return names;
}

}  // namespace

bool amx_takes(int64_t type, int64_t m) {
  return (type == kQ4_0 || type == kQ4_1 || type == kQ8_0) && m >= min_rows() && cpu_runs();
}

void amx_gemm(int64_t type, const uint8_t* packed, int64_t groups, int64_t blocks, const int8_t* q, const float* dx,
              const float* sx, int64_t m, const float* bias, float* y, int64_t n) {
#if defined(__AVX512F__)
  // Threads split the pairs of groups, as the VNNI kernel does; each unpacks its own.
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    if (type == kQ4_0) pairs<kQ4_0>(begin, end, packed, groups, blocks, q, dx, sx, m, bias, y, n);
    if (type == kQ4_1) pairs<kQ4_1>(begin, end, packed, groups, blocks, q, dx, sx, m, bias, y, n);
    if (type == kQ8_0) pairs<kQ8_0>(begin, end, packed, groups, blocks, q, dx, sx, m, bias, y, n);
  });
#endif
}

}  // namespace kvsentry_int8

TORCH_LIBRARY_FRAGMENT(kvsentry, m) { m.def("int8_gemm_kernels() -> str[]", &kvsentry_int8::kernels); }

#ifdef KVSENTRY_DEBUG_OPS
TORCH_LIBRARY_FRAGMENT(kvsentry_debug, m) {
  m.def("int8_gemm_amx_rows(int? min_rows=None) -> int", &kvsentry_int8::amx_rows);
}
#endif
