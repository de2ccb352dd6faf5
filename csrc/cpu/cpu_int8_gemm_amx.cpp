// The int8-activation GEMM of GGUF blocks on AMX-INT8 tiles, for the batches where the AVX512-VNNI
// kernel (cpu_int8_gemm.cpp, which quantizes the activations and calls this) falls behind: the
// same packed blocks, the same bits (engine/models/int8_reference.py's arithmetic, in its order).
//
//   torch.ops.kvsentry.int8_gemm_kernels() -> str[]   the kernels int8_gemm runs on this CPU, best
//            first: "amx_int8" (this file, from amx_min_rows() rows of Q4_0 / Q4_1 / Q8_0) and
//            "avx512_vnni" (every other call), or "avx_vnni" alone (cpu_int8_gemm_avx.cpp, on
//            CPUs without AVX-512); the registry's label names them
//   torch.ops.kvsentry_debug.int8_gemm_amx_rows(int? min_rows) -> int   the test build's switch:
//            the fewest rows the AMX path takes (set it past any batch to run VNNI alone)
//   torch.ops.kvsentry_debug.int8_amx_tile_peak(int iterations) -> float   multiply-adds per
//            second of tdpbssd on resident tiles, one thread (benchmarks/limits.py, int8_gemm.py)
//
// Why: the VNNI kernel spends 8 vpdpbusd per row, block of 32 K and 16 outputs on the integer
// sums alone, as many instructions again on their float32 scaling; from 8 rows up the bf16 AMX
// panels on the same blocks beat it (0.82x at 8 rows, 0.36x at 64). Here one tdpbssd takes a
// block's sums for 16 rows x 16 outputs, and the vector units do only the scaling the reference
// prescribes. That scaling, and tilestored (the one way out of a tile, which also stalls vector
// work beside it: ~25 cycles each of stores and of scaling took ~75 together on a Xeon core),
// bound the path: ~4-7% of the tile peak at 64 rows, where the bf16 panels' tiles accumulate
// K without a store per block (benchmarks/int8_gemm.py; docs/kernels.md).
//
// Per group of 16 outputs, per tile of up to 16 rows, block by block in K's order:
//   unpack  (the group's first row tile, as it goes; later tiles reuse it) the block into a B
//           tile of 8 rows x 64 bytes: byte 4r + j of row c is the weight of output r at
//           K = 4c + j, as the packed vectors already lie (their header): Q4_0 / Q4_1 vector c
//           gives row c (low nibbles) and row 4 + c (high nibbles), Q4_0 less 8; Q8_0's 8
//           vectors less their 128. All signed bytes (a Q4_1 nibble is 0-15).
//   sums    a C tile of int32 = A . B (tdpbssd: exact), A the 16 rows' quantized activations
//           as they lie (rows past M zero), stored to a ring of 4 slots; the products run 3
//           blocks ahead of the scaling, the store 1 block ahead, issued one instruction at a
//           time between the scaling's rows;
//   scale   per row: acc + (dw * dx) * isum (Q4_1: + mw * sx), each product and sum rounded on
//           its own (the *_round_ps intrinsics keep GCC from fusing them), acc in a register
//           from 0 at the first block to the last, then + bias.
// So a row's bits are the VNNI kernel's, whichever path its batch takes (tests/csrc/test_int8_gemm_amx.py).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_amx.h"
#include "cpu_int8_gemm.h"
#include "cpu_int8_gemm_amx.h"

namespace kvsentry_int8 {
namespace {

using namespace layout;  // the packed blocks' sizes (cpu_int8_gemm.h); a group's 16 outputs are one C tile's columns
constexpr int64_t kTileRows = 16;                    // batch rows per A tile
constexpr int64_t kTileInts = kTileRows * kGroup;    // int32 per C tile
constexpr int64_t kBTileBytes = 8 * 64;              // one block of one group: 8 rows of 4 K x 16 outputs
constexpr int64_t kRing = 4;                         // C tiles, and slots of their stored sums
constexpr int64_t kLead = 3;                         // blocks whose products run ahead of the scaling
constexpr int64_t kPrefetchBlocks = 8;               // blocks of the weight stream prefetched ahead of the unpacking
// Fewest rows the AMX path takes, at one thread and at more: see docs/kernels.md for the
// measurement. At 2 threads each thread's VNNI share of 8-9 rows still beat the tiles on
// SmolLM2's Q4_0 layers (3.86 against 4.80 ms at 8 rows) and tied on the 1B-class ones.
constexpr int64_t kMinRows = 8, kMinRowsThreads = 10;
int64_t auto_min_rows() { return at::get_num_threads() > 1 ? kMinRowsThreads : kMinRows; }


#ifdef KVSENTRY_DEBUG_OPS
std::atomic<int64_t> g_min_rows{-1};  // -1: auto_min_rows()
int64_t min_rows() {
  const int64_t set = g_min_rows.load(std::memory_order_relaxed);
  return set < 0 ? auto_min_rows() : set;
}
int64_t amx_rows(std::optional<int64_t> rows) {
  if (rows.has_value()) g_min_rows.store(*rows);
  return min_rows();
}
#else
int64_t min_rows() { return auto_min_rows(); }
#endif

#if defined(__AVX512F__)
#define KVS_AMX_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c,amx-tile,amx-int8")))
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// Tiles 0-3 are C, a ring: block b's sums in tile b % 4 (16 rows of 16 int32); 4-5 A by the
// block's parity (16 rows x 32 bytes of quantized activations); 6-7 B by parity (8 rows x 64 bytes).
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

// One group's blocks, unpacked: [blocks][8 rows x 64 bytes] B tiles, [blocks][16] float32 scales.
struct Group {
  kvsentry_amx::TileBuffer<int8_t> quants;
  kvsentry_amx::TileBuffer<float> dw, mw;
  explicit Group(int64_t blocks)
      : quants(static_cast<size_t>(blocks * kBTileBytes)), dw(static_cast<size_t>(blocks * kGroup)), mw(dw.size()) {}
};

// Block j of a group's packed blocks into w, when the row tile unpacks as it goes (`packed`
// set: the group's first), and the stream kPrefetchBlocks blocks on (the next group's, past
// this one's end) into L1: the weights stream at the pace of the products, as the VNNI kernel
// reads them, and the hardware prefetcher sees a steady stream.
template <int64_t kType>
KVS_AMX_INT8_TARGET __attribute__((always_inline)) inline void unpack_ahead(const uint8_t* packed, int64_t j,
                                                                            int64_t blocks, Group& w) {
  constexpr int64_t bytes = packed_bytes(kType);
  if (packed == nullptr || j >= blocks) return;
  unpack<kType>(packed + j * bytes, w.quants.data() + j * kBTileBytes, w.dw.data() + j * kGroup,
                w.mw.data() + j * kGroup);
  const char* ahead = reinterpret_cast<const char*>(packed + (j + kPrefetchBlocks) * bytes);
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// Where a row tile's scaling reads: block j's dx (and sx) of its 16 rows at dx[16 j] (rows past
// m zero), block j's scales at dw[16 j] (and mw).
struct Scales {
  const float *dx, *sx, *dw, *mw;
};

// The tile instructions of step S of a row tile (the step that scales block b + S, b a multiple
// of 4): block b + S + 1's store into its ring slot, then block b + S + 3's products (C tile
// (S + 3) % 4, A and B tiles by its parity). Issued one at a time between the scaling's rows:
// the tile unit queues few instructions, and one that finds the queue full holds up the vector
// work behind it. (The tile intrinsics take tile numbers as text: one specialization per step.)
template <int S>
struct StepTiles;
#define KVS_STEP_TILES(S, C, A, B, STORED)                                                        \
  template <>                                                                                    \
  struct StepTiles<S> {                                                                          \
    const int8_t* x;                                                                             \
    int64_t k;                                                                                   \
    const int8_t* quants;                                                                        \
    int32_t* sums;                                                                               \
    bool products, store;                                                                        \
    KVS_AMX_INT8_TARGET __attribute__((always_inline)) inline void issue(int op) const {        \
      if (op == 0 && store) _tile_stored(STORED, sums, 64);                                      \
      if (op == 1 && products) _tile_zero(C);                                                    \
      if (op == 2 && products) _tile_loadd(A, x, k);                                             \
      if (op == 3 && products) _tile_loadd(B, quants, 64);                                       \
      if (op == 4 && products) _tile_dpbssd(C, A, B);                                            \
    }                                                                                            \
  }
KVS_STEP_TILES(0, 3, 5, 7, 1);
KVS_STEP_TILES(1, 0, 4, 6, 2);
KVS_STEP_TILES(2, 1, 5, 7, 3);
KVS_STEP_TILES(3, 2, 4, 6, 0);
#undef KVS_STEP_TILES
constexpr int kStepTileOps = 5;

// acc[r] += (dw * dx[r]) * isum[r] (Q4_1: + mw * sx[r]) for block j of R rows, each product and
// sum rounded on its own (the *_round_ps intrinsics keep GCC from fusing them); the step's tile
// instructions between the rows.
template <int64_t kType, int R, int S>
KVS_AMX_INT8_TARGET __attribute__((always_inline)) inline void scale(__m512 (&acc)[R], const Scales& at, int64_t j,
                                                                     const int32_t* sums, const StepTiles<S>& tiles) {
  const __m512 dw = _mm512_load_ps(at.dw + kGroup * j);
  const __m512 mw = kType == kQ4_1 ? _mm512_load_ps(at.mw + kGroup * j) : dw;
  const float* dx = at.dx + kGroup * j;
  const float* sx = at.sx + kGroup * j;
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    #pragma GCC unroll 8
    for (int op = 0; op < kStepTileOps; ++op) {
      if (op * R / kStepTileOps == r) tiles.issue(op);
    }
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(sums + kGroup * r));
    __m512 term = _mm512_mul_round_ps(_mm512_mul_round_ps(dw, _mm512_set1_ps(dx[r]), kRound), dot, kRound);
    if (kType == kQ4_1) term = _mm512_add_round_ps(term, _mm512_mul_round_ps(mw, _mm512_set1_ps(sx[r]), kRound), kRound);
    acc[r] = _mm512_add_round_ps(acc[r], term, kRound);
  }
}

// One group's 16 outputs for a tile of up to 16 rows (R of them scaled, `rows` stored), summed
// over all blocks in order: acc[r] stays in a register from the first block to the last. Block
// j's products run 3 steps ahead of its scaling and its store 1 step ahead (C tiles and ring
// slots j % 4), so the tile unit works while the vector units scale.
template <int64_t kType, int R>
KVS_AMX_INT8_TARGET void row_tile(const int8_t* x, int64_t k, int64_t blocks, const uint8_t* packed, Group& w,
                                  const Scales& at, int32_t* ring, const float* bias, float* y, int64_t n,
                                  int64_t rows, __mmask16 mask) {
  static_assert(kLead == 3 && kRing == 4, "the steps' tiles lead by 3 blocks in a ring of 4");
  __m512 acc[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* quants = w.quants.data();
  for (int64_t j = 0; j < kLead; ++j) unpack_ahead<kType>(packed, j, blocks, w);
  // The rows' output lines, for writing, while the tile runs: their misses (rows n floats
  // apart, an LM head's 49152) would otherwise all stall the stores at its end.
  for (int64_t r = 0; r < rows; ++r) asm volatile("prefetchw %0" : : "m"(*reinterpret_cast<const char*>(y + r * n)));
  _tile_zero(0);
  _tile_loadd(4, x, k);
  _tile_loadd(6, quants, 64);
  _tile_dpbssd(0, 4, 6);
  if (blocks > 1) {
    _tile_zero(1);
    _tile_loadd(5, x + 32, k);
    _tile_loadd(7, quants + kBTileBytes, 64);
    _tile_dpbssd(1, 5, 7);
  }
  if (blocks > 2) {
    _tile_zero(2);
    _tile_loadd(4, x + 64, k);
    _tile_loadd(6, quants + 2 * kBTileBytes, 64);
    _tile_dpbssd(2, 4, 6);
  }
  _tile_stored(0, ring, 64);
  auto tiles = [&](int64_t j) {  // what step j's tiles read and write (j: the block it scales)
    return std::make_tuple(x + 32 * (j + 3), quants + (j + 3) * kBTileBytes, ring + (j + 1) % kRing * kTileInts,
                           j + 3 < blocks, j + 1 < blocks);
  };
  for (int64_t b = 0; b < blocks; b += 4) {
    {
      unpack_ahead<kType>(packed, b + kLead, blocks, w);
      auto [xs, qs, sums, products, store] = tiles(b);
      scale<kType, R>(acc, at, b, ring, StepTiles<0>{xs, k, qs, sums, products, store});
    }
    if (b + 1 >= blocks) break;
    {
      unpack_ahead<kType>(packed, b + 1 + kLead, blocks, w);
      auto [xs, qs, sums, products, store] = tiles(b + 1);
      scale<kType, R>(acc, at, b + 1, ring + kTileInts, StepTiles<1>{xs, k, qs, sums, products, store});
    }
    if (b + 2 >= blocks) break;
    {
      unpack_ahead<kType>(packed, b + 2 + kLead, blocks, w);
      auto [xs, qs, sums, products, store] = tiles(b + 2);
      scale<kType, R>(acc, at, b + 2, ring + 2 * kTileInts, StepTiles<2>{xs, k, qs, sums, products, store});
    }
    if (b + 3 >= blocks) break;
    {
      unpack_ahead<kType>(packed, b + 3 + kLead, blocks, w);
      auto [xs, qs, sums, products, store] = tiles(b + 3);
      scale<kType, R>(acc, at, b + 3, ring + 3 * kTileInts, StepTiles<3>{xs, k, qs, sums, products, store});
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (r >= rows) break;
    __m512 out = acc[r];
    if (bias != nullptr) out = _mm512_add_round_ps(out, _mm512_maskz_loadu_ps(mask, bias), kRound);
    _mm512_mask_storeu_ps(y + r * n, mask, out);
  }
}

// Groups [begin, end) for all m rows: each group's row tiles in turn, the first unpacking its
// blocks for the others. Tile state is per thread: configured here and released before returning.
//   dxt, sxt [row tiles, blocks, 16]: dx and sx transposed per tile of 16 rows (zero past m).
template <int64_t kType>
KVS_AMX_INT8_TARGET void groups_of(int64_t begin, int64_t end, const uint8_t* packed, int64_t blocks,
                                   const int8_t* q, const float* dxt, const float* sxt, int64_t m,
                                   const float* bias, float* y, int64_t n) {
  const kvsentry_amx::TileConfig config = tile_config();
  _tile_loadconfig(&config);
  const int64_t k = blocks * 32;
  Group w(blocks);
  kvsentry_amx::TileBuffer<int32_t> ring(static_cast<size_t>(kRing * kTileInts));
  for (int64_t g = begin; g < end; ++g) {
    const int64_t n0 = g * kGroup;
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(kGroup, n - n0)) - 1);
    const float* b = bias != nullptr ? bias + n0 : nullptr;
    for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, m - r0), tile = r0 / kTileRows;
      const Scales at{dxt + tile * blocks * kGroup, sxt + tile * blocks * kGroup, w.dw.data(), w.mw.data()};
      const uint8_t* blocks_of = r0 == 0 ? packed + g * blocks * packed_bytes(kType) : nullptr;
      const int8_t* x = q + r0 * k;
      float* out = y + r0 * n + n0;
      switch ((rows + 3) / 4) {
        case 4: row_tile<kType, 16>(x, k, blocks, blocks_of, w, at, ring.data(), b, out, n, rows, mask); break;
        case 3: row_tile<kType, 12>(x, k, blocks, blocks_of, w, at, ring.data(), b, out, n, rows, mask); break;
        case 2: row_tile<kType, 8>(x, k, blocks, blocks_of, w, at, ring.data(), b, out, n, rows, mask); break;
        default: row_tile<kType, 4>(x, k, blocks, blocks_of, w, at, ring.data(), b, out, n, rows, mask); break;
      }
    }
  }
  _tile_release();
}

bool cpu_runs() { return kvsentry_amx::int8_supported(); }

#ifdef KVSENTRY_DEBUG_OPS
// The AMX-INT8 tile peak of this thread, in multiply-adds per second: tdpbssd back to back on
// resident full tiles (A and B 16 x 64 bytes, 4 C tiles: 16 384 multiply-adds each).
KVS_AMX_INT8_TARGET double tile_peak(int64_t iterations) {
  TORCH_CHECK(cpu_runs(), "int8_amx_tile_peak: this CPU (or build, or process) has no AMX-INT8");
  const kvsentry_amx::TileConfig config({16, 16, 16, 16, 16, 16, 16, 16});
  _tile_loadconfig(&config);
  kvsentry_amx::TileBuffer<int8_t> data(16 * 64, 1);
  _tile_loadd(4, data.data(), 64);
  _tile_loadd(5, data.data(), 64);
  _tile_loadd(6, data.data(), 64);
  _tile_loadd(7, data.data(), 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, data.data(), 64);  // the products done before the clock stops
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  _tile_release();
  return 4.0 * static_cast<double>(iterations) * 16 * 16 * 64 / seconds;
}
#endif
#else
bool cpu_runs() { return false; }
#ifdef KVSENTRY_DEBUG_OPS
double tile_peak(int64_t) { TORCH_CHECK(false, "int8_amx_tile_peak: built without AVX-512"); }
#endif
#endif

// The tiles scale their sums with AVX-512: they join the 512-bit vector kernel only.
std::vector<std::string> kernels() {
  std::vector<std::string> names;
  const VectorIsa isa = vector_isa();
  if (cpu_runs() && isa == VectorIsa::kAvx512Vnni) names.emplace_back("amx_int8");
  if (isa != VectorIsa::kNone) names.emplace_back(isa_name(isa));
  return names;
}

}  // namespace

bool amx_takes(int64_t type, int64_t m) {
  return (type == kQ4_0 || type == kQ4_1 || type == kQ8_0) && m >= min_rows() && cpu_runs() &&
         vector_isa() == VectorIsa::kAvx512Vnni;
}

#if defined(__AVX512F__)
void amx_gemm(int64_t type, const uint8_t* packed, int64_t groups, int64_t blocks, const int8_t* q, const float* dx,
              const float* sx, int64_t m, const float* bias, float* y, int64_t n) {
  // dx and sx by tiles of 16 rows: [row tiles, blocks, 16], zero past m.
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  kvsentry_amx::TileBuffer<float> dxt(static_cast<size_t>(tiles * blocks * kGroup)), sxt(dxt.size());
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t slot = ((r / kTileRows) * blocks + b) * kGroup + r % kTileRows;
      dxt[slot] = dx[r * blocks + b];
      sxt[slot] = sx[r * blocks + b];
    }
  }
  // Threads split the groups; each unpacks its own.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    if (type == kQ4_0) groups_of<kQ4_0>(begin, end, packed, blocks, q, dxt.data(), sxt.data(), m, bias, y, n);
    if (type == kQ4_1) groups_of<kQ4_1>(begin, end, packed, blocks, q, dxt.data(), sxt.data(), m, bias, y, n);
    if (type == kQ8_0) groups_of<kQ8_0>(begin, end, packed, blocks, q, dxt.data(), sxt.data(), m, bias, y, n);
  });
}
#else
// Builds below AVX-512 have no AMX path: amx_takes is false there.
void amx_gemm(int64_t, const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const float*, int64_t,
              const float*, float*, int64_t) {}
#endif

}  // namespace kvsentry_int8

TORCH_LIBRARY_FRAGMENT(kvsentry, m) { m.def("int8_gemm_kernels() -> str[]", &kvsentry_int8::kernels); }

#ifdef KVSENTRY_DEBUG_OPS
TORCH_LIBRARY_FRAGMENT(kvsentry_debug, m) {
  m.def("int8_gemm_amx_rows(int? min_rows=None) -> int", &kvsentry_int8::amx_rows);
  m.def("int8_amx_tile_peak(int iterations) -> float", &kvsentry_int8::tile_peak);
}
#endif
