// GGUF-quantized panels: the panel GEMMs' weights (cpu_bf16_gemm.cpp, cpu_f32_gemm.cpp) kept
// in a checkpoint's Q4_1 or Q8_0 blocks, and dequantized inside those GEMMs, a block (or for
// many rows a panel) at a time, into the exact bf16 or float32 panel they pack from the
// dequantized weight.
//
// Why: a decode step of up to a few dozen rows reads every weight once, so its linears run at
// the speed of the weight stream. The default model's Q4_1 blocks are 0.625 bytes a weight and
// its Q8_0 LM head 1.06, against 2 in bf16 and 4 in float32: 96 MB a step instead of 269 MB
// (bf16) or 538 MB (float32). Dequantizing is exact -- d * q + m in float32 (the product of a
// float16 scale and a 4-bit integer is exact, so one rounding, as ggml's reference does it),
// then rounded to nearest even for bf16, as torch's cast does -- so the GEMM that follows sees
// the very values of the dequantized checkpoint, and its results are bit for bit those of the
// plain panels (tests/csrc/test_quant_panels.py).
//
// Layout: [panels, blocks, block bytes] uint8, one block per 32 of K (a GGUF block, and an
// AMX tile's 16 pairs of K) for the panel's 64 outputs: the 64 scales as float16 (and for
// Q4_1 the 64 minima), then the quants by pair of K p (16) and group of 16 outputs g (4). Each
// (p, g) is two vectors of 16 float32 lanes, A for outputs 0-7 of the group and B for 8-15,
// lane 2i + e holding output i (or 8 + i) at K = 2p + e: the bf16 panel's order. Q4_1: 16 bytes,
// byte j's low nibble A's lane j and high nibble B's; Q8_0: 32 bytes, A's 16 then B's 16.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstdlib>

#include "cpu_panel_gemm.h"
#include "cpu_prefetch.h"

namespace kvsentry_quant {

constexpr int64_t kQ4_1 = 3;  // GGML type ids
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kBlockK = 32;       // K per block
constexpr int64_t kOutputs = kvsentry_panels::kPanel;  // outputs per panel
constexpr int64_t kScales = kOutputs * 2;  // bytes of one float16 per output
constexpr int64_t kQ4Bytes = 2 * kScales + 16 * 4 * 16;
constexpr int64_t kQ8Bytes = kScales + 16 * 4 * 32;
// Blocks ahead whose lines each block asks into L2. The hardware prefetcher alone kept the
// blocks' stream at ~4.5 GB/s where the dequantizing runs at ~12 GB/s from L2 (1-core Xeon);
// with this ~9. 4, 8 and 12 blocks ahead measured alike.
constexpr int64_t kAheadBlocks = 12;

// The rows layout of Q4_1 blocks, for the bf16 GEMM's AMX tiles (quant_rows_pack): the weight
// as the tiles' A operand, one tile row per output and block (32 bf16, K in order), which each
// output's block fills with one table lookup. A Q4_1 weight takes one of 16 values per output and
// block, d * q + m: those 16, rounded to bf16, are a table that vpermw indexes by the 4-bit
// quants, once vpmultishiftqb has moved each K's nibble to the bottom of its 16-bit index.
// Against the panel layout's per-weight convert, multiply-add and round (cpu_quant_panels.h's
// dequant_bf16), that is ~5 vector instructions per output and block instead of ~9: on a Xeon core
// 1.28 against 2.17 ns per 32 weights from L1, about the memory stream's pace. The same values,
// bit for bit (the table's entries are those products, rounded by the same instruction).
//   [panels, blocks, 80, 16] uint8: per block the 64 outputs' float16 scales (128 bytes), their
//   minima (128), then 16 bytes of quants per output, K's nibble at rows_nibble(K) below.
constexpr int64_t kRowsQuantBytes = 16;  // one output's quants in a block
constexpr int64_t kRowsBlockBytes = 2 * kScales + kOutputs * kRowsQuantBytes;
// Where K's 4 bits lie in an output's 16 bytes of the rows layout: byte (first) and shift
// (second). Index word w = K of vpermw's 32 lies in qword w / 4, which vpmultishiftqb fills from
// the same qword of the 16 bytes broadcast to all four lanes, i.e. from their qword (w / 4) % 2;
// there K takes nibble (w / 8) * 4 + w % 4.
inline void rows_nibble(int64_t k, int64_t& byte, int& shift) {
  const int64_t slot = (k / 8) * 4 + k % 4;
  byte = (k / 4) % 2 * 8 + slot / 2;
  shift = static_cast<int>(slot % 2) * 4;
}

// Whether `packed` is quant_rows_pack's rows layout: [panels, blocks, 80, 16] uint8, contiguous.
inline bool is_rows_layout(const at::Tensor& packed) {
  return packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
         packed.size(2) * packed.size(3) == kRowsBlockBytes && packed.size(3) == kRowsQuantBytes;
}

// Bytes of one block of a panel for a GGML type, 0 for a type without panels.
inline int64_t block_bytes(int64_t type) { return type == kQ4_1 ? kQ4Bytes : type == kQ8_0 ? kQ8Bytes : 0; }
// The GGML type of a panel block of `bytes` bytes (the packed tensor's last dim), -1 for none.
inline int64_t type_of(int64_t bytes) { return bytes == kQ4Bytes ? kQ4_1 : bytes == kQ8Bytes ? kQ8_0 : -1; }

// A packed weight: `panel_bytes` apart, `blocks` blocks of `type` each.
struct Panels {
  const uint8_t* data = nullptr;
  int64_t type = -1, blocks = 0, panel_bytes = 0;
  const uint8_t* panel(int64_t p) const { return data + p * panel_bytes; }
  // The packed [panels, blocks, bytes] tensor's data, blocks and bytes.
  static Panels of(const uint8_t* data, int64_t blocks, int64_t bytes) {
    return Panels{data, type_of(bytes), blocks, blocks * bytes};
  }
};

#if defined(__AVX512F__)
// One block of a panel as float32 lanes: at(p, g, A, B) for pair of K p and group of outputs g,
// A and B as the layout note above lays them out. (Members, not a template taking a lambda:
// GCC compiles a lambda without its enclosing function's target, so a bf16 store in one would
// not build.)
struct BlockLanes {
  __m512 da[4], db[4], ma[4], mb[4];
  const uint8_t* q;
  bool q4;

  // Lane 2i + e of A reads scale i of group g, of B scale 8 + i.
  __attribute__((target("avx512f"), always_inline)) static void lane_scales(const uint8_t* half, int g, __m512& a,
                                                                            __m512& b) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + 32 * g)));
    const __m512i ia = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    a = _mm512_permutexvar_ps(ia, s);
    b = _mm512_permutexvar_ps(_mm512_add_epi32(ia, _mm512_set1_epi32(8)), s);
  }

  __attribute__((target("avx512f"), always_inline)) BlockLanes(const uint8_t* src, int64_t type)
      : q4(type == kQ4_1) {
    for (int g = 0; g < 4; ++g) lane_scales(src, g, da[g], db[g]);
    if (q4) {
      for (int g = 0; g < 4; ++g) lane_scales(src + kScales, g, ma[g], mb[g]);
    }
    q = src + (q4 ? 2 * kScales : kScales);
  }

  __attribute__((target("avx512f"), always_inline)) void at(int p, int g, __m512& a, __m512& b) const {
    const int i = p * 4 + g;
    if (q4) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i)));
      // d * q + m: the product is exact (11 by 4 bits), so fused or not it rounds once.
      a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F))), da[g], ma[g]);
      b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), db[g], mb[g]);
    } else {
      const __m128i* v = reinterpret_cast<const __m128i*>(q + 32 * i);
      a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v))), da[g]);
      b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v + 1))), db[g]);
    }
  }
};

// Pair `pair`'s sixteenth of the lines of the block kAheadBlocks past `src` (of `bytes`), into L2.
inline void prefetch_ahead(const uint8_t* src, int64_t bytes, int pair) {
  const char* ahead = reinterpret_cast<const char*>(src) + kAheadBlocks * bytes;
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t l = pair * lines / 16; l < (pair + 1) * lines / 16; ++l) kvsentry_mem::prefetch_l2(ahead + 64 * l);
}

// Blocks [b0, b1) of panel `p` into the bf16 GEMM's panel layout (16 pairs x 64 x 2 bf16 a
// block, from dst).
__attribute__((target("avx512f,avx512bf16"))) inline void dequant_bf16(const Panels& w, int64_t p, int64_t b0,
                                                                       int64_t b1, uint16_t* dst) {
  const int64_t bytes = block_bytes(w.type);
  const uint8_t* src = w.panel(p) + b0 * bytes;
  for (int64_t blk = b0; blk < b1; ++blk, src += bytes) {
    const BlockLanes lanes(src, w.type);
    for (int pair = 0; pair < 16; ++pair) {
      prefetch_ahead(src, bytes, pair);
      for (int g = 0; g < 4; ++g, dst += 32) {
        __m512 a, b;
        lanes.at(pair, g, a, b);
        // B's lanes go high: cvtne2ps puts its second operand in the low half.
        _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
      }
    }
  }
}

// Whether this CPU runs the rows layout's lookups (AVX512-VBMI's vpmultishiftqb, AVX512-BW's
// vpermw, AVX512-BF16's rounding).
inline bool rows_supported() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
  return has;
}

// Nothing between a block's lookups (dequant_rows' `between` where no tiles run beside them).
struct NothingBetween {
  void operator()(int) const {}
};

// One block of the rows layout (`src`, kRowsBlockBytes) into 64 rows of 32 bf16 at dst (64 bytes
// apart: four AMX A tiles of 16 outputs). Two outputs at a time: their two tables in one vector
// (A's in words 0-15, B's in 16-31), so B's indices carry bit 4. between(g) runs before outputs
// 16 g.. (the GEMM's tile instructions for the previous block, spread through this one's).
template <typename Between = NothingBetween>
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16,f16c,amx-tile,amx-bf16"))) inline void dequant_rows(
    const uint8_t* src, uint16_t* dst, const Between& between = Between()) {
  alignas(64) float d[kOutputs], m[kOutputs];
  for (int i = 0; i < 4; ++i) {
    _mm512_store_ps(d + 16 * i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * i))));
    _mm512_store_ps(m + 16 * i,
                    _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kScales + 32 * i))));
  }
  // vpmultishiftqb's control: byte b of the result (qword i = b / 8, word j = b % 8 / 2 in it)
  // takes the 8 bits from nibble (i / 2) * 4 + j of its qword on (rows_nibble): the low 4 are K's.
  const __m512i control = _mm512_set_epi64(0x3c3c383834343030, 0x3c3c383834343030, 0x2c2c282824242020,
                                           0x2c2c282824242020, 0x1c1c181814141010, 0x1c1c181814141010,
                                           0x0c0c080804040000, 0x0c0c080804040000);
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i nibble = _mm512_set1_epi16(0x000F), second = _mm512_set1_epi16(0x0010);
  const uint8_t* q = src + 2 * kScales;
  for (int o = 0; o < kOutputs; o += 2) {
    if (o % 4 == 0) prefetch_ahead(src, kRowsBlockBytes, o / 4);
    if (o % 16 == 0) between(o / 16);
    // d * q + m for q = 0..15: the product is exact, so this is each weight's one rounding.
    const __m512 ta = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[o]), _mm512_set1_ps(m[o]));
    const __m512 tb = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[o + 1]), _mm512_set1_ps(m[o + 1]));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(tb, ta);
    const __m512i qa = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * o)));
    const __m512i qb = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * o + 16)));
    const __m512i ia = _mm512_and_si512(_mm512_multishift_epi64_epi8(control, qa), nibble);
    const __m512i ib = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(control, qb), nibble, second, 0xEA);
    _mm512_store_si512(dst + 32 * o, _mm512_permutexvar_epi16(ia, table));
    _mm512_store_si512(dst + 32 * o + 32, _mm512_permutexvar_epi16(ib, table));
  }
}

// float32 lanes rounded to the nearest bf16, ties to even, as torch's cast rounds them, and kept
// as float32 (the low 16 bits zero). For finite values (a NaN's payload may carry into the sign):
// a block's d * q + m always is (a NaN or infinite scale makes quant_panels' pack-time check
// refuse the blocks); to_bf16 below fixes NaN up.
__attribute__((target("avx512f"), always_inline)) inline __m512 round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// float32 lanes to bf16, to nearest even, NaN to torch's quiet NaN (0x7FC0): c10::BFloat16's
// rounding, without AVX512-BF16's vcvtneps2bf16 (which also flushes denormals). The bf16 GEMM's
// and the prefill tiles' outputs.
__attribute__((target("avx512f"), always_inline)) inline __m256i to_bf16(__m512 v) {
  __m512i up = _mm512_srli_epi32(_mm512_castps_si512(round_to_bf16(v)), 16);
  up = _mm512_mask_mov_epi32(up, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(up);
}

// Blocks [b0, b1) of panel `p` into the float32 GEMM's panel layout (32 K x 64 float32 a block,
// from dst): K = 2 pair + e is the e lanes of A, then of B. kBf16: each value rounded to bf16
// first -- a bf16 model's weight, multiplied in float32 on CPUs without AVX512-BF16
// (cpu_bf16_gemm.cpp's "avx512f" kernel).
template <bool kBf16 = false>
__attribute__((target("avx512f"))) inline void dequant_f32(const Panels& w, int64_t p, int64_t b0, int64_t b1,
                                                          float* dst) {
  const int64_t bytes = block_bytes(w.type);
  const uint8_t* src = w.panel(p) + b0 * bytes;
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t blk = b0; blk < b1; ++blk, src += bytes) {
    const BlockLanes lanes(src, w.type);
    for (int pair = 0; pair < 16; ++pair, dst += 2 * kOutputs) {
      prefetch_ahead(src, bytes, pair);
      for (int g = 0; g < 4; ++g) {
        __m512 a, b;
        lanes.at(pair, g, a, b);
        if (kBf16) {
          a = round_to_bf16(a);
          b = round_to_bf16(b);
        }
        _mm512_storeu_ps(dst + 16 * g, _mm512_permutex2var_ps(a, even, b));
        _mm512_storeu_ps(dst + kOutputs + 16 * g, _mm512_permutex2var_ps(a, odd, b));
      }
    }
  }
}

// This thread's buffer of at least `bytes`, 64-byte aligned (a panel's dequantized rows are
// whole cache lines), kept for the thread's next panel.
inline void* scratch(int64_t bytes) {
  struct Buffer {
    void* data = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffer;
  if (buffer.size < bytes) {
    std::free(buffer.data);
    buffer.size = (bytes + 63) / 64 * 64;
    buffer.data = std::aligned_alloc(64, static_cast<size_t>(buffer.size));
  }
  return buffer.data;
}

// Panel p dequantized into this thread's scratch, in the bf16 or the float32 panel layout.
__attribute__((target("avx512f,avx512bf16"))) inline const uint16_t* bf16_panel(const Panels& w, int64_t p) {
  auto* dst = static_cast<uint16_t*>(scratch(w.blocks * kBlockK * kOutputs * 2));
  dequant_bf16(w, p, 0, w.blocks, dst);
  return dst;
}

template <bool kBf16 = false>
__attribute__((target("avx512f"))) inline const float* f32_panel(const Panels& w, int64_t p) {
  auto* dst = static_cast<float*>(scratch(w.blocks * kBlockK * kOutputs * 4));
  dequant_f32<kBf16>(w, p, 0, w.blocks, dst);
  return dst;
}
#endif

}  // namespace kvsentry_quant
