// What the int8-activation GEMM's kernels share: the packed layout's sizes (cpu_int8_gemm.cpp's
// header describes the layout), a row's quantized activations, the vector ISA the op runs on, and
// the 256-bit AVX-VNNI kernel's entry points (cpu_int8_gemm_avx.cpp).
#pragma once

#include <cstdint>

#include "cpu_prefetch.h"

namespace kvsentry_int8 {

namespace layout {
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;  // GGML type ids
constexpr int64_t kBlockK = 32;
constexpr int64_t kGroup = 16;  // outputs per packed group: one int32 lane each of a 512-bit vector
// Packed K-quant super-block: where its parts start.
constexpr int64_t kQ4KScales = 64, kQ4KMins = 192, kQ4KQuants = 320, kQ4KBytes = 320 + 8 * 256;
constexpr int64_t kQ6KScales = 32, kQ6KQuants = 288, kQ6KBlock = 384, kQ6KBytes = 288 + 8 * 384;

constexpr int64_t block_values(int64_t type) { return type == kQ4_K || type == kQ6_K ? 256 : kBlockK; }
constexpr int64_t scale_bytes(int64_t type) { return type == kQ4_1 ? 4 * kGroup : 2 * kGroup; }
constexpr int64_t quant_vectors(int64_t type) { return type == kQ8_0 ? 8 : type == kQ5_0 ? 5 : 4; }
constexpr int64_t packed_bytes(int64_t type) {
  return type == kQ4_K ? kQ4KBytes : type == kQ6_K ? kQ6KBytes : scale_bytes(type) + 64 * quant_vectors(type);
}
}  // namespace layout

// How far ahead of the block it works on a kernel asks each group's stream into L2. The packed
// weight is one contiguous stream per group, but the hardware prefetcher alone kept a decode
// step's GEMVs at 11-12 GB/s: it does not cross 4 KiB and ramps up again after every jump between
// the groups' streams. 30 layers of the default model's Q4_1 shapes at 1 batch row, AVX512-VNNI,
// 1-core Xeon (2026-12-05), in one process alternating: none 4.37 ms, 8 KiB 3.43, 16 KiB 3.27,
// 24 KiB 3.17; at 4 rows none 7.29, 16 KiB 5.28.
constexpr int64_t kPrefetchBytes = 16384;

// The `bytes` (a block's share of one group) that lie kPrefetchBytes past `block`, into L2. Past
// the tensor's end this is harmless: prefetches never fault.
inline void prefetch_ahead(const uint8_t* block, int64_t bytes) {
  const char* ahead = reinterpret_cast<const char*>(block + kPrefetchBytes);
  for (int64_t o = 0; o < bytes; o += 64) kvsentry_mem::prefetch_l2(ahead + o);
}

// The activations of one row, quantized per block of 32: int8 quants, scale dx, the quants' sum
// and sx = dx * sum (as int8_reference.quantize_activations), and the sum of the first 16 (Q6_K's
// sub-blocks of 16).
struct QuantRow {
  int8_t* q;
  float* dx;
  int32_t* sum;
  float* sx;
  int32_t* half;
};

// The vector kernel int8_gemm runs on: the best this CPU (and build) has, or in the test build the
// one kvsentry_debug.int8_gemm_isa chose. AMX-INT8 tiles join only the 512-bit one (they scale with it).
enum class VectorIsa { kNone, kAvx512Vnni, kAvxVnni };
VectorIsa vector_isa();
const char* isa_name(VectorIsa isa);  // "avx512_vnni", "avx_vnni", "none"

// AVX-VNNI (VEX-encoded 256-bit vpdpbusd, with AVX2, F16C and FMA): whether this CPU has it;
// the quantization of one row of x [blocks * 32] float32; y [m, n] float32 = the rows times
// int8_gemm_pack's blocks of `type` [groups, blocks of the type, packed bytes] (+ bias [n] or
// nullptr). The bits of the AVX512-VNNI kernel and of engine/models/int8_reference.py.
bool avx_vnni_cpu();
void avx_vnni_quantize_row(const float* x, int64_t blocks, QuantRow out);
void avx_vnni_gemm(int64_t type, const uint8_t* packed, int64_t groups, int64_t blocks, const QuantRow* rows,
                   int64_t m, const float* bias, float* y, int64_t n);

}  // namespace kvsentry_int8
