// The softmax's exp, shared by the attention kernels (cpu_attention.cpp, cpu_attention_amx.cpp).
#pragma once

#include <cstdint>

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

}  // namespace kvsentry_math
