// Sixteen vectors' horizontal reductions at once: lane i of the result reduces v[i]'s 16 lanes.
// Four rounds of shuffles and `op`, where reducing one vector at a time takes four rounds for
// each. `op` is any lane-wise associative operation on 32-bit lanes (float add or max, integer
// add through casts); the tree's order is fixed, so a float sum has the same bits every call.
// Used by the decode attention's scores (cpu_attention.cpp) and the int8 GEMM's quantizer
// (cpu_int8_gemm.cpp). AVX-512F translation units only.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kvsentry_simd {

template <typename Op>
__attribute__((always_inline)) inline __m512 reduce16(const __m512* v, Op op) {
  __m512 w[8], z[4], u[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i] (low + high half), lanes 8-15: v[2i+1]
    w[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int j = 0; j < 4; ++j) {  // 128-bit quarter k: v[4j + k]
    z[j] = op(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88), _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  }
  for (int m = 0; m < 2; ++m) {  // quarter k, lanes 0-1: v[8m + k], lanes 2-3: v[8m + 4 + k]
    u[m] = op(_mm512_shuffle_ps(z[2 * m], z[2 * m + 1], 0x44), _mm512_shuffle_ps(z[2 * m], z[2 * m + 1], 0xEE));
  }
  // Lane 4k + j: v[4j + k]. Put v[i] in lane i.
  const __m512 s = op(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
}

struct AddPs {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
};
struct MaxPs {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_max_ps(a, b); }
};
struct AddEpi32 {
  __m512 operator()(__m512 a, __m512 b) const {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
};

}  // namespace kvsentry_simd
#endif
