// The exps the kernels share: the softmax's (cpu_attention.cpp, cpu_attention_amx.cpp,
// cpu_prefill_attention_amx.cpp, cpu_prefill_attention.cpp) and the bf16 SiLU's (cpu_fused_ops.cpp).
#pragma once

#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvsentry_math {

// exp(x) for the softmax, in a form the compiler vectorises (std::exp is a scalar libm
// call per element and was most of the kernel's time): x = n ln2 + r, |r| <= ln2/2,
// exp(r) by a degree-6 Taylor polynomial (relative error < 2e-7 on that interval),
// 2^n through the exponent bits. Exact 0 below the float range (so a masked -inf
// score gets weight exactly 0) and NaN in, NaN out.
inline float fast_exp(float x) {
  const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // Round to nearest by the 1.5 * 2^23 trick (exact for |n| < 2^22; -ffast-math would break it).
  const float n = (clamped * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = clamped - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  union { float f; int32_t i; } scale;
  scale.i = (static_cast<int32_t>(n) + 127) << 23;
  const float e = p * scale.f;
  return x != x ? x : (x < -87.0f ? 0.f : e);
}

#if defined(__AVX512F__)
// 16 lanes of the same exp, its 2^n by vscalefps: exp of a value past the float range
// overflows to inf and underflows to 0 (through denormals), +inf -> inf, -inf -> 0, NaN -> NaN.
// The clamp only keeps n finite (max/min return their second operand, x, on NaN). A degree-5
// polynomial: relative error ~2e-7 on |r| <= ln2/2. For bf16 results it is exact where it
// matters: a bf16 SiLU through it rounds to torch's (Sleef's) bits for all 65,536 bf16 inputs
// (tests/csrc/test_fused_ops.py checks every one).
__attribute__((target("avx512f"))) inline __m512 fast_exp_ps(__m512 x) {
  const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(104.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 120.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
// exp for a softmax's weights: fast_exp_ps, with arguments below e^-87 (masked keys: -inf)
// weighing exactly 0. Clamped first: a denormal result, even one blended away, costs a
// microcode assist per vector (the AMX prefill kernel ran 40% slower with masked keys reaching it).
__attribute__((target("avx512f"))) inline __m512 softmax_exp_ps(__m512 x) {
  const __m512 floor = _mm512_set1_ps(-87.0f);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ), fast_exp_ps(_mm512_max_ps(floor, x)),
                              _mm512_setzero_ps());
}

// The prefill kernels' scores, one 16-lane vector a key (lanes: the queries): each of keys
// [0, live) scaled and masked causally in place (key k reaches lane l only if k <= seen[l]: -inf
// otherwise); returns each lane's maximum, NaN where any of its scores is NaN (as torch's max).
__attribute__((target("avx512f"))) inline __m512 scale_mask_max(float* sc, int64_t live, __m512i seen, float scale) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  const __m512 factor = _mm512_set1_ps(scale);
  __m512 best = neg_inf;
  __mmask16 nan = 0;
  for (int64_t key = 0; key < live; ++key) {
    float* s = sc + key * 16;
    const __mmask16 allowed = _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(key)), seen);
    const __m512 v = _mm512_mask_blend_ps(allowed, neg_inf, _mm512_mul_ps(_mm512_loadu_ps(s), factor));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
    _mm512_storeu_ps(s, v);
  }
  return _mm512_mask_blend_ps(nan, best, _mm512_set1_ps(__builtin_nanf("")));
}
#endif

}  // namespace kvsentry_math
