// Paged decode attention on the CPU, namespace `kvsentry`:
//
//   torch.ops.kvsentry.paged_decode_attention(out, query, key_cache, value_cache,
//       block_tables, seq_lens, read_blocks=None, num_read_blocks, scale) -> ()
//
// One query token per row, read straight out of the paged cache: no gather
// of K/V into a contiguous copy (the torch path's main cost), no materialised
// score tensor. Work items are (request, kv head) pairs run in parallel by
// torch's intra-op pool; the G query heads that share a kv head are done
// together, so every K and V row is read once per item.
//
// Semantics are those of the torch reference (engine/attention.py,
// decode_attention_reference) on purpose, null block included: row b reads
// read_blocks[b] table entries (all rows num_read_blocks when None) -- the
// longest length in its group of similar lengths -- so a shorter request's
// unused entries point at block 0 and are read like real kernels read
// padding. Positions at or past seq_len get probability 0, and the value
// product still runs over them: 0 x NaN = NaN, so a NaN planted in block 0
// reaches the output exactly as it does through the reference. The sentinel,
// not this kernel, guards block 0.
//
// Prefill uses it too: the token at position p of a request is a row with
// seq_len = p + 1 over that request's table row (causal attention, one query
// at a time; engine/attention.py, PrefillPlan). On this project's CPU that is
// faster than torch's flash SDPA, whose inner GEMMs take MKL's generic path.
//
// Accumulation is float32 for every cache dtype (float32, bfloat16, float16). On CPUs with
// AVX512-BF16 a bf16 cache's scores and value product multiply bf16 pairs (vdpbf16ps); the
// value product then takes the probabilities rounded to bf16, as the reference's softmax
// `.to(v.dtype)` does.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <algorithm>
#include <atomic>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_amx.h"
#include "cpu_attention_amx.h"
#include "cpu_fast_exp.h"
#include "cpu_paged_prefetch.h"
#include "cpu_quant_panels.h"
#include "cpu_reduce16.h"
#include "../common/debug_switch.h"

namespace {

using at::Tensor;

constexpr const char* kOp = "kvsentry::paged_decode_attention";
constexpr int64_t kMaxWideDim = 256;  // the wide path keeps a key row in registers
constexpr int64_t kMaxSharedGroup = 8;  // query heads per KV head that share one V row load

// s = sum_d a[d] * b[d], vectorised: 16 independent partial sums need no
// reassociation of a single float sum, so -O3 vectorises them without -ffast-math.
template <typename scalar_t>
inline float dot(const float* a, const scalar_t* b, int64_t n) {
  float partial[16] = {0};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    for (int i = 0; i < 16; ++i) partial[i] += a[d + i] * static_cast<float>(b[d + i]);
  }
  float s = 0.f;
  for (; d < n; ++d) s += a[d] * static_cast<float>(b[d]);
  for (int i = 0; i < 16; ++i) s += partial[i];
  return s;
}

inline float sum(const float* x, int64_t n) {
  float partial[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 16; ++k) partial[k] += x[i + k];
  }
  float s = 0.f;
  for (; i < n; ++i) s += x[i];
  for (int k = 0; k < 16; ++k) s += partial[k];
  return s;
}

template <typename scalar_t>
inline void axpy(float p, const scalar_t* x, float* acc, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += p * static_cast<float>(x[d]);
}

// 16 floats in a GCC vector: one zmm with AVX-512, two ymm with AVX2, four xmm otherwise.
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

template <typename scalar_t>
inline vf16 load16(const scalar_t* p) {
  float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
}

// bf16 -> float is the top half of the float's bits: widen the 16 raw halves and shift,
// in vector registers (the generic path converts one element at a time through memory
// and was most of the bf16 kernel's time). Exact, NaN and Inf included.
typedef uint16_t vu16x16 __attribute__((vector_size(32)));
typedef uint32_t vu32x16 __attribute__((vector_size(64)));

inline vf16 load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  // Two instructions (zero-extend the halves, shift); the generic form below compiles to a
  // chain of extracts and inserts, and this load is the inner loop of the value product.
  const __m512 v = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  return reinterpret_cast<const vf16&>(v);
#else
  vu16x16 halves;
  std::memcpy(&halves, p, sizeof halves);
  const vu32x16 bits = __builtin_convertvector(halves, vu32x16) << 16;
  vf16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}

// Tree sum of 16 lanes (a running scalar sum would be a 16-add dependency chain).
inline float hsum16(vf16 v) {
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Row operations on a head's vectors. Wide: dims are multiples of 16 (32, 64, 128...),
// the query and accumulator live in vf16 chunks. Narrow: any dims, plain loops.
template <bool kWide>
struct RowOps;

template <>
struct RowOps<true> {
  static constexpr int kLanes = 16;
  template <typename scalar_t>
  static float dot(const float* q, const scalar_t* k, int64_t dim) {
    const vf16* qv = reinterpret_cast<const vf16*>(q);
    vf16 acc = qv[0] * load16(k);
    for (int64_t c = 1; c < dim / 16; ++c) acc += qv[c] * load16(k + 16 * c);
    return hsum16(acc);
  }
  template <typename scalar_t>
  static void axpy(float p, const scalar_t* x, float* acc, int64_t dim) {
    vf16* av = reinterpret_cast<vf16*>(acc);
    for (int64_t c = 0; c < dim / 16; ++c) av[c] += p * load16(x + 16 * c);
  }
};

template <>
struct RowOps<false> {
  template <typename scalar_t>
  static float dot(const float* q, const scalar_t* k, int64_t dim) { return ::dot(q, k, dim); }
  template <typename scalar_t>
  static void axpy(float p, const scalar_t* x, float* acc, int64_t dim) { ::axpy(p, x, acc, dim); }
};

#if defined(__AVX512F__)
// Scores sixteen keys at a time (AVX-512 builds). A score is a 16-lane product summed
// across its lanes; summing each key's lanes on its own (hsum16 per key and query head)
// was most of the kernel's time. Here the sixteen keys' lane vectors are reduced
// together: four rounds of shuffles and adds leave key t's sum in lane t.
constexpr bool kTiles = true;

// Lane i = the sum of v[i]'s 16 lanes (cpu_reduce16.h).
__attribute__((always_inline)) inline __m512 reduce16(const __m512* v) {
  return kvsentry_simd::reduce16(v, kvsentry_simd::AddPs{});
}

template <typename scalar_t>
inline __m512 widen16(const scalar_t* p) {  // 16 values as float32 lanes
  const vf16 v = load16(p);
  return reinterpret_cast<const __m512&>(v);
}

// Lane t < n: q . k_t, for the n <= 16 key rows at k + t * stride (float accumulation of the
// widened rows, any cache dtype); lanes past n: 0.
template <typename scalar_t>
inline __m512 tile_dot(const float* q, const scalar_t* k, int64_t stride, int n, int64_t dim) {
  __m512 acc[16];
  if (n == 16) {
    // Chunk by chunk over the 16 rows: sixteen independent chains, where a row at a time waits
    // out the multiply-add latency at every chunk (~3x the kernel's scores on a Xeon). Each
    // row's sum keeps the order below (the first chunk's product, then fused multiply-adds).
    const __m512 q0 = _mm512_loadu_ps(q);
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_mul_ps(q0, widen16(k + t * stride));
    for (int64_t c = 1; c < dim / 16; ++c) {
      const __m512 qc = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(qc, widen16(k + t * stride + 16 * c), acc[t]);
    }
    return reduce16(acc);
  }
  for (int t = 0; t < 16; ++t) {
    if (t < n) {
      const scalar_t* row = k + t * stride;
      vf16 a = load16(q) * load16(row);
      for (int64_t c = 1; c < dim / 16; ++c) a += load16(q + 16 * c) * load16(row + 16 * c);
      acc[t] = reinterpret_cast<const __m512&>(a);
    } else {
      acc[t] = _mm512_setzero_ps();
    }
  }
  return reduce16(acc);
}

// The same for a bfloat16 query and cache on CPUs with AVX512-BF16: vdpbf16ps multiplies
// bf16 pairs exactly and adds them in float32, 32 dims per instruction with no widening.
// The query is bf16 already (the q projection's output), so nothing is rounded that the
// float path keeps; only the summation order (and denormal inputs, which it reads as 0)
// differ from tile_dot.
// Sixteen full rows, C = dim / 32 chunks: chunk by chunk over the rows, so the sixteen chains are
// independent and live in registers (a row at a time waited out vdpbf16ps's latency at every
// chunk, and the generic loop below zeroed and spilled its accumulators through the stack).
// Each row's sum keeps the generic order: zero, then chunk 0, 1, ... in turn.
template <int C>
__attribute__((target("avx512f,avx512bf16"), always_inline)) inline __m512 tile_dot_bf16_full(
    const c10::BFloat16* q, const c10::BFloat16* k, int64_t stride) {
  __m512 acc[16];
  const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q);
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    acc[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(k + t * stride));
  }
#pragma GCC unroll 8
  for (int c = 1; c < C; ++c) {
    const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + 32 * c);
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      acc[t] = _mm512_dpbf16_ps(acc[t], qc, (__m512bh)_mm512_loadu_si512(k + t * stride + 32 * c));
    }
  }
  return reduce16(acc);
}

__attribute__((target("avx512f,avx512bf16"), noinline)) __m512 tile_dot_bf16(const c10::BFloat16* q,
                                                                                 const c10::BFloat16* k,
                                                                                 int64_t stride, int n,
                                                                                 int64_t dim) {
  if (n == 16) {
    switch (dim) {
      case 32: return tile_dot_bf16_full<1>(q, k, stride);
      case 64: return tile_dot_bf16_full<2>(q, k, stride);
      case 96: return tile_dot_bf16_full<3>(q, k, stride);
      case 128: return tile_dot_bf16_full<4>(q, k, stride);
      case 192: return tile_dot_bf16_full<6>(q, k, stride);
      case 256: return tile_dot_bf16_full<8>(q, k, stride);
      default: break;
    }
  }
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) {
    acc[t] = _mm512_setzero_ps();
    if (t < n) {
      const c10::BFloat16* row = k + t * stride;
      for (int64_t c = 0; c < dim / 32; ++c) {
        acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_loadu_si512(q + 32 * c),
                                  (__m512bh)_mm512_loadu_si512(row + 32 * c));
      }
    }
  }
  return reduce16(acc);
}

bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#else
constexpr bool kTiles = false;
bool cpu_has_bf16_dot() { return false; }
#endif

// Tests turn the bf16 dot product off to check the widening path on the same CPU, and the
// AMX path (cpu_attention_amx.cpp) off to check the vector kernel's (debug builds only).
kvsentry_debug::Switch g_bf16_dot_enabled;
kvsentry_debug::Switch g_amx_enabled;

// Ask for the next block's rows while this block computes: table order is arbitrary, so
// the hardware prefetcher cannot guess it, and the kernel is otherwise memory-latency bound.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* block, int64_t rows, int64_t row_stride, int64_t dim) {
  constexpr int64_t kPerLine = 64 / sizeof(scalar_t);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t d = 0; d < dim; d += kPerLine) __builtin_prefetch(block + t * row_stride + d);
  }
}

// 64-byte aligned float scratch, so the wide path may view it as vf16 chunks.
struct Scratch {
  explicit Scratch(int64_t n) : data(static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64 + 64))) {}
  ~Scratch() { std::free(data); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float& operator[](int64_t i) { return data[i]; }
  float* data;
};

// acc[g * v_dim + d] = sum over positions of probs[g * span + pos] * v[pos][d] for the G query
// heads sharing a KV head: one 16-lane output chunk at a time, accumulated in registers (G is
// a compile-time constant, or the accumulators live on the stack), each V row loaded (and
// widened) once for the whole group. A head's V rows stay in L2 across the chunks.
// Output chunks [c0, c0 + C) of it, G x C accumulators: each position's weights multiply C
// chunks of its V row at once, so G x C independent chains hide the multiply-add latency that
// one chunk's G chains waited out at every position (each output keeps its order of positions).
template <int G, int C, typename scalar_t>
inline void value_chunks(const scalar_t* vc, int64_t vs0, int64_t vs1, const int32_t* table, int64_t ts1,
                         int64_t reads, int64_t block_size, const float* probs, int64_t span, int64_t v_dim,
                         float* acc, int64_t c0) {
  vf16 a[G][C] = {};
  for (int64_t j = 0; j < reads; ++j) {
    const scalar_t* vblock = vc + static_cast<int64_t>(table[j * ts1]) * vs0 + 16 * c0;
    const float* pj = probs + j * block_size;
    for (int64_t t = 0; t < block_size; ++t) {
      vf16 v[C];
      for (int i = 0; i < C; ++i) v[i] = load16(vblock + t * vs1 + 16 * i);
      for (int g = 0; g < G; ++g) {
        const float p = pj[g * span + t];
        for (int i = 0; i < C; ++i) a[g][i] += p * v[i];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < C; ++i) std::memcpy(acc + g * v_dim + 16 * (c0 + i), &a[g][i], sizeof a[g][i]);
  }
}

template <int G, typename scalar_t>
void value_product(const scalar_t* vc, int64_t vs0, int64_t vs1, const int32_t* table, int64_t ts1, int64_t reads,
                   int64_t block_size, const float* probs, int64_t span, int64_t v_dim, float* acc) {
  constexpr int kWide = G <= 6 ? 4 : 2;  // chunks a pass: G x kWide accumulators within 32 registers
  int64_t c = 0;
  for (; c + kWide <= v_dim / 16; c += kWide) {
    value_chunks<G, kWide>(vc, vs0, vs1, table, ts1, reads, block_size, probs, span, v_dim, acc, c);
  }
  for (; c < v_dim / 16; ++c) value_chunks<G, 1>(vc, vs0, vs1, table, ts1, reads, block_size, probs, span, v_dim, acc, c);
}

// f(std::integral_constant<int, G>{}) for the query group G in [1, kMaxSharedGroup]: the value
// products take G as a compile-time constant.
template <typename F>
void with_group(int64_t group, F&& f) {
  static_assert(kMaxSharedGroup == 8, "one case per shared group size");
  switch (group) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: TORCH_CHECK(false, kOp, ": no shared value product for ", group, " query heads per KV head");
  }
}

#if defined(__AVX512F__)
// The value product for a bf16 cache on CPUs with AVX512-BF16: the probabilities rounded to bf16
// first, as the reference does (its softmax `.to(v.dtype)` before the matmul), then vdpbf16ps over
// pairs of positions, 32 products an instruction where the widened path's FMAs do 16. pb holds
// the G heads' probabilities as bf16 (`span` apart; block_size even, so a pair never straddles
// blocks). Two rows' 32 dims interleave into pairs with one unpack each way: lane 4L + j of the
// low half is dim 8L + j of the slice, of the high half 8L + 4 + j; acc gets them back in order.
// S slices of 32 dims a pass keep G x 2S accumulators in registers.
template <int G, int S>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void value_slices_bf16(
    const c10::BFloat16* vc, int64_t vs0, int64_t vs1, const int32_t* table, int64_t ts1, int64_t reads,
    int64_t block_size, const uint16_t* pb, int64_t span, int64_t v_dim, float* acc, int64_t s0) {
  __m512 a[G][S][2];
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < S; ++i) a[g][i][0] = a[g][i][1] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < reads; ++j) {
    const c10::BFloat16* vblock = vc + static_cast<int64_t>(table[j * ts1]) * vs0 + 32 * s0;
    const uint16_t* pj = pb + j * block_size;
    for (int64_t t = 0; t < block_size; t += 2) {
      __m512i lo[S], hi[S];
      for (int i = 0; i < S; ++i) {
        const __m512i r0 = _mm512_loadu_si512(vblock + t * vs1 + 32 * i);
        const __m512i r1 = _mm512_loadu_si512(vblock + (t + 1) * vs1 + 32 * i);
        lo[i] = _mm512_unpacklo_epi16(r0, r1);
        hi[i] = _mm512_unpackhi_epi16(r0, r1);
      }
      for (int g = 0; g < G; ++g) {
        uint32_t pair;
        std::memcpy(&pair, pj + g * span + t, 4);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int i = 0; i < S; ++i) {
          a[g][i][0] = _mm512_dpbf16_ps(a[g][i][0], (__m512bh)lo[i], w);
          a[g][i][1] = _mm512_dpbf16_ps(a[g][i][1], (__m512bh)hi[i], w);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < S; ++i) {
      alignas(64) float half[2][16];
      _mm512_store_ps(half[0], a[g][i][0]);
      _mm512_store_ps(half[1], a[g][i][1]);
      float* out = acc + g * v_dim + 32 * (s0 + i);
      for (int h = 0; h < 2; ++h) {
        for (int lane = 0; lane < 16; ++lane) out[8 * (lane / 4) + 4 * h + lane % 4] = half[h][lane];
      }
    }
  }
}

template <int G>
void value_product_bf16(const c10::BFloat16* vc, int64_t vs0, int64_t vs1, const int32_t* table, int64_t ts1,
                        int64_t reads, int64_t block_size, const uint16_t* pb, int64_t span, int64_t v_dim,
                        float* acc) {
  constexpr int kSlices = G <= 6 ? 2 : 1;  // 32-dim slices a pass: G x 2 x kSlices accumulators
  int64_t s = 0;
  for (; s + kSlices <= v_dim / 32; s += kSlices) {
    value_slices_bf16<G, kSlices>(vc, vs0, vs1, table, ts1, reads, block_size, pb, span, v_dim, acc, s);
  }
  for (; s < v_dim / 32; ++s) value_slices_bf16<G, 1>(vc, vs0, vs1, table, ts1, reads, block_size, pb, span, v_dim, acc, s);
}

// Probabilities to bf16 as torch's .to(bfloat16) rounds them (kvsentry_quant::to_bf16).
__attribute__((target("avx512f,avx512bw"))) void probs_to_bf16(const float* p, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(out + i, lanes, kvsentry_quant::to_bf16(_mm512_maskz_loadu_ps(lanes, p + i)));
  }
}

// The G heads' value product of value_product_bf16 for a bf16 cache when `value_dot` (then true);
// any other cache dtype has none (false), and the widened path runs.
template <typename scalar_t>
bool value_product_dot(bool, int64_t, const scalar_t*, int64_t, int64_t, const int32_t*, int64_t, int64_t, int64_t,
                       float*, int64_t, int64_t, int64_t, void*, float*) {
  return false;
}

bool value_product_dot(bool value_dot, int64_t group, const c10::BFloat16* vhead, int64_t vs0, int64_t vs1,
                       const int32_t* table, int64_t ts1, int64_t reads, int64_t block_size, float* probs,
                       int64_t row_span, int64_t span, int64_t v_dim, void* scratch, float* acc) {
  if (!value_dot) return false;
  uint16_t* pb = static_cast<uint16_t*>(scratch);
  for (int64_t g = 0; g < group; ++g) probs_to_bf16(probs + g * span, row_span, pb + g * span);
  with_group(group, [&](auto g) {
    value_product_bf16<decltype(g)::value>(vhead, vs0, vs1, table, ts1, reads, block_size, pb, span, v_dim, acc);
  });
  return true;
}

constexpr int64_t kMaxTileGroup = 64;  // query heads per KV head the tiled scores handle

// probs[g * span + pos] = scale * (q_g . k_pos) for the positions pos < len, -inf past it,
// over the row's `reads` table entries; top[g] = the largest score, NaN when any score is
// NaN (as torch's max, so the softmax spreads it).
template <typename scalar_t>
void scores_tiled(const kvsentry_paged::ItemAhead<scalar_t>& ahead, const scalar_t* q, int64_t qs1, const float* qf, const scalar_t* kc, int64_t ks0, int64_t ks1,
                  const scalar_t* vc, int64_t vs0, int64_t vs1, int64_t v_dim,
                  const int32_t* table, int64_t ts1, int64_t reads, int64_t block_size, int64_t len, int64_t group,
                  int64_t head_dim, int64_t span, float scale, float* probs, float* top, bool bf16_dot) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 best[kMaxTileGroup];
  __mmask16 nan[kMaxTileGroup];
  for (int64_t g = 0; g < group; ++g) {
    best[g] = neg_inf;
    nan[g] = 0;
  }
  for (int64_t j = 0; j < reads; ++j) {
    const scalar_t* kblock = kc + static_cast<int64_t>(table[j * ts1]) * ks0;
    if (j + 1 < reads) {
      prefetch_rows(kc + static_cast<int64_t>(table[(j + 1) * ts1]) * ks0, block_size, ks1, head_dim);
    }
    // The value rows too, for the value product that follows: it walks the same blocks.
    prefetch_rows(vc + static_cast<int64_t>(table[j * ts1]) * vs0, block_size, vs1, v_dim);
    // An item ahead's K and V blocks into L2, one of its blocks per block of ours: table order
    // scatters a request's blocks, and without this the kernel waits on DRAM (cpu_paged_prefetch.h).
    ahead.block(j);
    for (int64_t t0 = 0; t0 < block_size; t0 += 16) {
      const int64_t pos0 = j * block_size + t0;
      const int n = static_cast<int>(std::min<int64_t>(16, block_size - t0));
      const __mmask16 lanes = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      if (pos0 >= len) {  // all masked: no key to read
        for (int64_t g = 0; g < group; ++g) _mm512_mask_storeu_ps(probs + g * span + pos0, lanes, neg_inf);
        continue;
      }
      const int live_n = static_cast<int>(std::min<int64_t>(n, len - pos0));
      const __mmask16 live = live_n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << live_n) - 1);
      const scalar_t* krows = kblock + t0 * ks1;
      for (int64_t g = 0; g < group; ++g) {
        __m512 s;
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          s = bf16_dot ? tile_dot_bf16(q + g * qs1, krows, ks1, n, head_dim)
                       : tile_dot(qf + g * head_dim, krows, ks1, n, head_dim);
        } else {
          s = tile_dot(qf + g * head_dim, krows, ks1, n, head_dim);
        }
        s = _mm512_mask_blend_ps(live, neg_inf, _mm512_mul_ps(s, scale_v));
        nan[g] |= _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
        best[g] = _mm512_max_ps(best[g], s);
        _mm512_mask_storeu_ps(probs + g * span + pos0, lanes, s);
      }
    }
  }
  for (int64_t j = reads; j < ahead.reads; ++j) ahead.block(j);  // an item ahead's blocks past ours
  for (int64_t g = 0; g < group; ++g) {
    top[g] = nan[g] ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(best[g]);
  }
}
#endif

template <typename scalar_t, bool kWide>
void decode_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                      const Tensor& block_tables, const Tensor& seq_lens, const int32_t* read_blocks,
                      int64_t num_read, float scale) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t v_dim = value_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t span = num_read * block_size;  // most positions a request reads (scratch stride)

  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = key_cache.data_ptr<scalar_t>();
  const scalar_t* vc = value_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1), ks2 = key_cache.stride(2);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1), vs2 = value_cache.stride(2);
  const int64_t ts0 = block_tables.stride(0), ts1 = block_tables.stride(1);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  [[maybe_unused]] const bool bf16_dot = std::is_same_v<scalar_t, c10::BFloat16> && head_dim % 32 == 0 &&
                                         kvsentry_amx::bf16_dot_enabled();
  [[maybe_unused]] const bool value_dot = bf16_dot && kWide && group <= kMaxSharedGroup && block_size % 2 == 0 &&
                                          v_dim % 32 == 0;

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    using Ops = RowOps<kWide>;
    Scratch qf(group * head_dim), probs(group * span), acc(group * v_dim), top(group);
    Scratch pbf(value_dot ? (group * span + 1) / 2 : 0);  // the probabilities as bf16, value_dot's
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t reads = read_blocks != nullptr ? read_blocks[b] : num_read;  // this row's table entries
      const int64_t row_span = reads * block_size;
      const auto ahead = kvsentry_paged::item_ahead(item, end, num_kv_heads, tables, ts0, ts1, read_blocks, num_read,
                                                    kc, ks0, ks1, ks2, vc, vs0, vs1, vs2, block_size, head_dim, v_dim);
      // Items without the tiled scores touch the first line of an item ahead's block-heads
      // (cpu_paged_prefetch.h); the tiled scores stream its blocks whole.
#if defined(__AVX512F__)
      const bool tiled = kWide && group <= kMaxTileGroup;
#else
      const bool tiled = false;
#endif
      if (!tiled) ahead.first_lines();
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qrow = q + b * qs0 + (h * group + g) * qs1;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(qrow[d]);
        top[g] = kNegInf;
      }
      // Scores, masked past the sequence's length.
#if defined(__AVX512F__)
      if (tiled) {
        scores_tiled<scalar_t>(ahead, q + b * qs0 + h * group * qs1, qs1, qf.data, kc + h * ks2, ks0, ks1,
                               vc + h * vs2, vs0, vs1, v_dim, tables + b * ts0, ts1, reads, block_size, len, group, head_dim, span, scale,
                               probs.data, top.data, bf16_dot);
      } else
#endif
      for (int64_t j = 0; j < reads; ++j) {
        const scalar_t* kblock = kc + static_cast<int64_t>(tables[b * ts0 + j * ts1]) * ks0 + h * ks2;
        if (j + 1 < reads) {
          prefetch_rows(kc + static_cast<int64_t>(tables[b * ts0 + (j + 1) * ts1]) * ks0 + h * ks2, block_size, ks1,
                        head_dim);
        }
        for (int64_t t = 0; t < block_size; ++t) {
          const int64_t pos = j * block_size + t;
          if constexpr (kWide) {
            // Load (and for bf16 widen) the key row once for the whole query group.
            vf16 krow[kMaxWideDim / 16];
            if (pos < len) {
              for (int64_t c = 0; c < head_dim / 16; ++c) krow[c] = load16(kblock + t * ks1 + 16 * c);
            }
            for (int64_t g = 0; g < group; ++g) {
              float s = kNegInf;
              if (pos < len) {
                const vf16* qv = reinterpret_cast<const vf16*>(&qf[g * head_dim]);
                vf16 a = qv[0] * krow[0];
                for (int64_t c = 1; c < head_dim / 16; ++c) a += qv[c] * krow[c];
                s = hsum16(a) * scale;
                top[g] = (s > top[g] || std::isnan(s)) ? s : top[g];
              }
              probs[g * span + pos] = s;
            }
            continue;
          }
          for (int64_t g = 0; g < group; ++g) {
            float s = kNegInf;
            if (pos < len) {
              s = Ops::dot(&qf[g * head_dim], kblock + t * ks1, head_dim) * scale;
              // A NaN score must win the max, as in torch's softmax.
              top[g] = (s > top[g] || std::isnan(s)) ? s : top[g];
            }
            probs[g * span + pos] = s;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* p = &probs[g * span];
        for (int64_t pos = 0; pos < row_span; ++pos) p[pos] = kvsentry_math::fast_exp(p[pos] - top[g]);
        const float total = sum(p, row_span);
        for (int64_t pos = 0; pos < row_span; ++pos) p[pos] /= total;
      }
      // Weighted values over every position read, masked ones with weight 0.
      if constexpr (kWide) {
        // One 16-lane output chunk at a time, accumulated in registers (two chains, to
        // hide the FMA latency); a head's V rows stay in L2 across the chunks. Small query
        // groups load (and widen) each V row once for the whole group.
        if (group <= kMaxSharedGroup) {
          const scalar_t* vhead = vc + h * vs2;
          const int32_t* table = tables + b * ts0;
#if defined(__AVX512F__)
          const bool dot = value_product_dot(value_dot, group, vhead, vs0, vs1, table, ts1, reads, block_size,
                                             probs.data, row_span, span, v_dim, pbf.data, acc.data);
#else
          const bool dot = false;
#endif
          if (!dot) {
            with_group(group, [&](auto g) {
              value_product<decltype(g)::value>(vhead, vs0, vs1, table, ts1, reads, block_size, probs.data, span,
                                                v_dim, acc.data);
            });
          }
        } else for (int64_t g = 0; g < group; ++g) {
          for (int64_t c = 0; c < v_dim / 16; ++c) {
            vf16 a0 = {}, a1 = {};
            for (int64_t j = 0; j < reads; ++j) {
              const scalar_t* vblock =
                  vc + static_cast<int64_t>(tables[b * ts0 + j * ts1]) * vs0 + h * vs2 + 16 * c;
              const float* pj = &probs[g * span + j * block_size];
              int64_t t = 0;
              for (; t + 2 <= block_size; t += 2) {
                a0 += pj[t] * load16(vblock + t * vs1);
                a1 += pj[t + 1] * load16(vblock + (t + 1) * vs1);
              }
              if (t < block_size) a0 += pj[t] * load16(vblock + t * vs1);
            }
            const vf16 total = a0 + a1;
            std::memcpy(&acc[g * v_dim + 16 * c], &total, sizeof total);
          }
        }
      } else {
        std::fill(acc.data, acc.data + group * v_dim, 0.f);
        for (int64_t j = 0; j < reads; ++j) {
          const scalar_t* vblock = vc + static_cast<int64_t>(tables[b * ts0 + j * ts1]) * vs0 + h * vs2;
          for (int64_t t = 0; t < block_size; ++t) {
            const int64_t pos = j * block_size + t;
            for (int64_t g = 0; g < group; ++g) {
              Ops::axpy(probs[g * span + pos], vblock + t * vs1, &acc[g * v_dim], v_dim);
            }
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* orow = o + b * os0 + (h * group + g) * os1;
        for (int64_t d = 0; d < v_dim; ++d) orow[d] = static_cast<scalar_t>(acc[g * v_dim + d]);
      }
    }
  });
}

void check(const Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
           const Tensor& block_tables, const Tensor& seq_lens, const std::optional<Tensor>& read_blocks,
           int64_t num_read) {
  TORCH_CHECK(query.dim() == 3, kOp, ": query must be [batch, num_heads, head_dim], got shape ", query.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4, kOp,
              ": caches must be [num_blocks, block_size, num_kv_heads, dim], got ", key_cache.sizes(), " and ",
              value_cache.sizes());
  TORCH_CHECK(key_cache.size(0) == value_cache.size(0) && key_cache.size(1) == value_cache.size(1) &&
                  key_cache.size(2) == value_cache.size(2),
              kOp, ": key_cache ", key_cache.sizes(), " and value_cache ", value_cache.sizes(),
              " disagree on blocks, block size or kv heads");
  TORCH_CHECK(key_cache.size(3) == query.size(2), kOp, ": key head_dim ", key_cache.size(3),
              " must equal query head_dim ", query.size(2));
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, kOp, ": num_heads ", query.size(1),
              " must be a multiple of num_kv_heads ", key_cache.size(2));
  TORCH_CHECK(out.dim() == 3 && out.size(0) == query.size(0) && out.size(1) == query.size(1) &&
                  out.size(2) == value_cache.size(3),
              kOp, ": out must be [batch, num_heads, v_dim] = [", query.size(0), ", ", query.size(1), ", ",
              value_cache.size(3), "], got ", out.sizes());
  for (const Tensor* t : {&out, &key_cache, &value_cache}) {
    TORCH_CHECK(t->scalar_type() == query.scalar_type(), kOp, ": every tensor must have query's dtype ",
                query.scalar_type(), ", got ", t->scalar_type());
  }
  for (const Tensor* t : {&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens}) {
    TORCH_CHECK(t->device() == query.device(), kOp, ": every tensor must be on query's device ", query.device(),
                ", got one on ", t->device());
  }
  for (const Tensor* t : {&out, &query, &key_cache, &value_cache}) {
    TORCH_CHECK(t->stride(-1) == 1, kOp, ": tensors must have a contiguous last dimension, got strides ",
                t->strides());
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                  block_tables.size(0) >= query.size(0) && block_tables.size(1) >= num_read,
              kOp, ": block_tables must be int32 [>= batch, >= num_read_blocks], got ", block_tables.scalar_type(),
              " ", block_tables.sizes());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong && seq_lens.size(0) >= query.size(0) &&
                  seq_lens.stride(0) == 1,
              kOp, ": seq_lens must be a contiguous int64 [>= batch], got ", seq_lens.scalar_type(), " ",
              seq_lens.sizes());
  TORCH_CHECK(num_read >= 0, kOp, ": num_read_blocks must be >= 0, got ", num_read);
  if (read_blocks.has_value()) {
    const Tensor& r = *read_blocks;
    TORCH_CHECK(r.dim() == 1 && r.scalar_type() == at::kInt && r.size(0) >= query.size(0) &&
                    (r.stride(0) == 1 || r.size(0) <= 1) && r.device() == query.device(),
                kOp, ": read_blocks must be a contiguous int32 [>= batch] on query's device, got ", r.scalar_type(),
                " ", r.sizes());
  }
}

void paged_decode_attention_cpu(Tensor& out, const Tensor& query, const Tensor& key_cache,
                                const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
                                const std::optional<Tensor>& read_blocks, int64_t num_read_blocks, double scale) {
  check(out, query, key_cache, value_cache, block_tables, seq_lens, read_blocks, num_read_blocks);
  if (query.size(0) == 0) return;
  // Plain loops over the few ints read, not at::aminmax: that cloned the strided table slice
  // and synced through .item() four times per layer call.
  const int64_t batch = query.size(0), block_size = key_cache.size(1), num_blocks = key_cache.size(0);
  const int32_t* reads = nullptr;
  if (read_blocks.has_value()) {
    reads = read_blocks->data_ptr<int32_t>();
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(reads[b] >= 0 && reads[b] <= num_read_blocks, kOp, ": read_blocks must lie in [0, num_read_blocks = ",
                  num_read_blocks, "], got ", reads[b], " at row ", b);
    }
  }
  // A row whose length runs past what it reads would silently drop its newest tokens.
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t span = (reads != nullptr ? reads[b] : num_read_blocks) * block_size;
    TORCH_CHECK(lens[b] <= span, kOp, ": seq_lens[", b, "] = ", lens[b], " exceeds the ", span,
                " positions its row reads (read_blocks or num_read_blocks times block_size)");
  }
  // A table entry outside the pool would read out of bounds: check the ones read.
  const int32_t* table = block_tables.data_ptr<int32_t>();
  const int64_t ts0 = block_tables.stride(0), ts1 = block_tables.stride(1);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < num_read_blocks; ++j) {
      const int32_t entry = table[b * ts0 + j * ts1];
      TORCH_CHECK(entry >= 0 && entry < num_blocks, kOp, ": block table entries must lie in [0, ", num_blocks,
                  "), got ", entry, " at [", b, ", ", j, "]");
    }
  }
  if (kvsentry_amx::attention_amx_enabled() &&
      kvsentry_amx::decode_attention_amx_fits(query, key_cache, value_cache)) {
    kvsentry_amx::decode_attention_amx(out, query, key_cache, value_cache, block_tables, seq_lens, reads,
                                       num_read_blocks, static_cast<float>(scale));
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    if (query.size(2) % 16 == 0 && query.size(2) <= kMaxWideDim && value_cache.size(3) % 16 == 0) {
      decode_attention<scalar_t, true>(out, query, key_cache, value_cache, block_tables, seq_lens, reads,
                                       num_read_blocks, static_cast<float>(scale));
    } else {
      decode_attention<scalar_t, false>(out, query, key_cache, value_cache, block_tables, seq_lens, reads,
                                        num_read_blocks, static_cast<float>(scale));
    }
  });
}

void paged_decode_attention_meta(Tensor& out, const Tensor& query, const Tensor& key_cache,
                                 const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
                                 const std::optional<Tensor>& read_blocks, int64_t num_read_blocks, double scale) {
  check(out, query, key_cache, value_cache, block_tables, seq_lens, read_blocks, num_read_blocks);
}

#ifdef KVSENTRY_DEBUG_OPS
// Whether bf16 scores use AVX512-BF16 dot products (the CPU has them and they are not
// turned off); `enable` turns them on or off first (tests check both paths on one CPU).
bool cpu_bf16_dot(std::optional<bool> enable) {
  if (enable.has_value()) g_bf16_dot_enabled.set(*enable);
  return kvsentry_amx::bf16_dot_enabled();
}

// Whether bf16 caches of the shapes they take go through the AMX paths, decode's and prefill's
// (the CPU has AMX-BF16 and they are not turned off); `enable` turns them on or off first.
bool cpu_attention_amx(std::optional<bool> enable) {
  if (enable.has_value()) g_amx_enabled.set(*enable);
  return kvsentry_amx::supported() && g_amx_enabled.on();
}
#endif

}  // namespace

bool kvsentry_amx::attention_amx_enabled() { return g_amx_enabled.on(); }

bool kvsentry_amx::bf16_dot_enabled() { return cpu_has_bf16_dot() && g_bf16_dot_enabled.on(); }

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor? read_blocks, int num_read_blocks, float scale) -> ()");
}

#ifdef KVSENTRY_DEBUG_OPS
TORCH_LIBRARY_FRAGMENT(kvsentry_debug, m) {
  m.def("cpu_bf16_dot(bool? enable=None) -> bool", &cpu_bf16_dot);
  m.def("cpu_attention_amx(bool? enable=None) -> bool", &cpu_attention_amx);
}
#endif

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention_cpu); }

TORCH_LIBRARY_IMPL(kvsentry, Meta, m) { m.impl("paged_decode_attention", &paged_decode_attention_meta); }
