// Fused elementwise ops of a decoder layer, on CPU: fewer, fatter ops per layer.
//
//   out = torch.ops.kvsentry.rms_norm(x, weight, eps)
//   out, res = torch.ops.kvsentry.add_rms_norm(x, residual, weight, eps)
//     x, residual  [T, N] float32 or bfloat16, contiguous
//     weight       [N], x's dtype
//     res          residual + x in x's dtype (one rounding); rms_norm normalises x itself
//     out          weight * (r * res.float()).to(dtype), r = rsqrt(mean(res.float()^2) + eps)
//
//   q_out, k_out = torch.ops.kvsentry.rotary(q, k, cos, sin, positions)
//     q [T, Hq, D], k [T, Hk, D] float32 or bfloat16, any strides with a contiguous last dim
//     cos, sin [P, D] contiguous tables, float32 or q's dtype; positions [T] int64 in [0, P)
//     out = q * c + rotate_half(q) * s, c = cos[pos].to(dtype), s = sin[pos].to(dtype)
//
//   out = torch.ops.kvsentry.silu_and_mul(gate_up)
//     gate_up [T, 2 I] float32 or bfloat16, a contiguous last dim; out [T, I] contiguous
//     out = silu(gate) * up, gate, up = gate_up.chunk(2, -1)
//
// All reproduce the Hugging Face modules (LlamaRMSNorm, apply_rotary_pos_emb, LlamaMLP) bit
// for bit: every elementwise op rounds to its dtype exactly where torch's would (bf16 ops
// compute in float and round once), there is no FMA contraction (the pragma below), and what
// is not plain arithmetic is torch's own: the sum of squares is at::sum's over the float32 rows
// that x.pow(2) gives (a replica of its summation order, checked against at::sum once per width,
// else at::sum itself, 256 rows per call; the mean divides it by N), and
// SiLU is torch's formula with torch's exp (Sleef's, as ATen's vector loop calls it). The torch references
// (engine/ops/fused_ops.py) define the results; tests/csrc/test_fused_ops.py holds the
// kernels to them bit for bit.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <dlfcn.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <atomic>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_fast_exp.h"

namespace {

using at::Tensor;

// Element I/O on raw storage: bf16 <-> float by bit operations, branch-free so that the
// loops vectorise; the same values as c10::BFloat16's conversions (round to nearest even;
// any NaN stays a NaN).
template <typename T>
struct Io;
template <>
struct Io<float> {
  using raw = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
template <>
struct Io<c10::BFloat16> {
  using raw = uint16_t;
  static float load(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static uint16_t store(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    return v != v ? static_cast<uint16_t>(0x7FC0) : rounded;
  }
};
// v rounded to T and back: what a torch op in dtype T keeps of a float result.
template <typename T>
inline float round_to(float v) { return Io<T>::load(Io<T>::store(v)); }
template <typename T>
inline const typename Io<T>::raw* raw_ptr(const Tensor& t) {
  return reinterpret_cast<const typename Io<T>::raw*>(t.data_ptr<T>());
}
template <typename T>
inline typename Io<T>::raw* raw_mut(const Tensor& t) {
  return reinterpret_cast<typename Io<T>::raw*>(t.data_ptr<T>());
}

#if defined(__AVX512F__)
// Sixteen elements at a time, with the scalar Io's exact semantics: bf16 widens by a shift,
// narrows by round-to-nearest-even on the bits with every NaN stored as 0x7FC0. The loops
// above did not vectorise (the NaN select), and these ops are elementwise over every
// activation of a prefill chunk.
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
  static __m512 round(__m512 v) { return v; }
  static __m512 store_rounded(float* p, __m512 v) {
    store(p, v);
    return v;
  }
};
template <>
struct Vec<c10::BFloat16> {
  static __m512 widen(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }
  static __m512 load(const uint16_t* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static __m512i bits(__m512 v) {  // the bf16 bits of v in each 32-bit lane's low half
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  }
  // v as 16 bf16: by vcvtneps2bf16 where the CPU has AVX512-BF16 -- the same round to nearest
  // even, but it reads denormals as zero and keeps a NaN's sign and payload, so a vector holding
  // either takes the bit operations above. One instruction and a class test instead of ~9: on one
  // Xeon core, 2048 x 576 add_rms_norm 736 -> 622 us, 2048 x 1536 silu_and_mul 1665 -> 1403,
  // 2048 tokens' rotary 707 -> 530 (~20 ms of a 2048-token prefill step's ~540).
  // (Inline asm: the file is built for plain AVX-512, and a target attribute does not reach the
  // lambdas these loops run in.)
  static __m256i narrow(__m512 v) {
    if (kHardwareRound) {
      __m256i r;
      asm("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(v));
      // QNaN (0x01), denormal (0x20), SNaN (0x80)
      if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0xA1) == 0, 1)) return r;
    }
    return _mm512_cvtepi32_epi16(bits(v));
  }
  static void store(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(v)); }
  static __m512 round(__m512 v) { return widen(narrow(v)); }
  // v rounded to bf16, stored at p and returned: one rounding for both (round, then store,
  // narrowed the same value twice).
  static __m512 store_rounded(uint16_t* p, __m512 v) {
    const __m256i b = narrow(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b);
    return widen(b);
  }
  static inline const bool kHardwareRound = __builtin_cpu_supports("avx512bf16");
};
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 0;  // no vector path: the scalar loops do everything
#endif

bool fused_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

void check_norm(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight) {
  constexpr const char* op = "kvsentry::rms_norm";
  TORCH_CHECK(fused_dtype(x.scalar_type()) && x.dim() == 2 && x.is_contiguous(), op,
              ": x must be contiguous float32 or bfloat16 [T, N], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous(),
              op, ": weight must be contiguous [N] of x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->sizes() == x.sizes() &&
                    residual->is_contiguous(),
                op, ": residual must be contiguous, of x's dtype and shape");
  }
}

// torch's float32 sum of one contiguous row, as at::sum over the last dim computes it on CPU
// (aten/src/ATen/native/cpu/SumKernel.cpp: cascade_sum -> vectorized_inner_sum for a row of at
// least one vector): the row as vectors of L lanes, vector 4 i + k into accumulator k (each a
// cascade of levels flushed every 16 i), the vectors past the last four into accumulator 0,
// accumulators 1-3 added to 0, then a scalar sum of the elements past the last vector followed
// by accumulator 0's lanes in order, stored as 0 + that. L is the lane count of torch's
// Vectorized<float> in the kernel torch runs (8 on the Xeon with AVX-512 of 2026-12: its sum kernel
// is the AVX2 one there; `row_sum_for` finds out by asking at::sum itself).
//
// Why: the norm called at::sum_out once per 256 rows -- a dispatch, a TensorIterator and a
// pass over a float32 squares buffer -- 30-40% of a decode step's add_rms_norm (one Xeon core).
template <int L>
float torch_row_sum(const float* x, int64_t n) {
  constexpr int kLevels = 4, kIlp = 4, kPower = 4;  // levels of 16: rows below 4 M elements
  const int64_t vectors = n / L, size = vectors / kIlp, step = int64_t{1} << kPower, mask = step - 1;
  float acc[kLevels][kIlp][L] = {};
  auto add = [](float* a, const float* b) {
    for (int l = 0; l < L; ++l) a[l] += b[l];
  };
  int64_t i = 0;
  for (; i + step <= size;) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      for (int k = 0; k < kIlp; ++k) add(acc[0][k], x + (i * kIlp + k) * L);
    }
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        add(acc[j][k], acc[j - 1][k]);
        std::fill(acc[j - 1][k], acc[j - 1][k] + L, 0.0f);
      }
      if ((i & (mask << (j * kPower))) != 0) break;
    }
  }
  for (; i < size; ++i) {
    for (int k = 0; k < kIlp; ++k) add(acc[0][k], x + (i * kIlp + k) * L);
  }
  for (int j = 1; j < kLevels; ++j) {
    for (int k = 0; k < kIlp; ++k) add(acc[0][k], acc[j][k]);
  }
  for (int64_t v = size * kIlp; v < vectors; ++v) add(acc[0][0], x + v * L);
  for (int k = 1; k < kIlp; ++k) add(acc[0][0], acc[0][k]);
  float total = 0.0f;
  for (int64_t e = vectors * L; e < n; ++e) total += x[e];
  for (int l = 0; l < L; ++l) total += acc[0][0][l];
  return 0.0f + total;  // the output is zero-filled, then accumulated into
}

using RowSum = float (*)(const float*, int64_t);

// The replica of at::sum that gives at::sum's bits for rows of n on this CPU and this torch,
// or nullptr (at::sum itself): rows narrower than a vector (torch sums those another way), or a
// torch whose vectors are neither 16 nor 8 wide. Found once per n by asking at::sum: 64 rows of
// positive values spread over twelve binary orders of magnitude (made by a fixed LCG, not torch's
// generator: the answer must not depend on what ran before), on which different summation
// orders round differently; a candidate must match every row, and only one may.
RowSum row_sum_for(int64_t n) {
  // A model norms one width: the thread's last answer spares each call the lock and the map.
  thread_local int64_t last_n = -1;
  thread_local RowSum last = nullptr;
  if (n == last_n) return last;
  static std::mutex lock;
  static std::map<int64_t, RowSum> known;
  std::lock_guard<std::mutex> guard(lock);
  const auto found = known.find(n);
  if (found != known.end()) {
    last_n = n;
    return last = found->second;
  }
  RowSum chosen = nullptr;
  if (n >= 16 && n < (int64_t{1} << 22)) {
    constexpr int64_t kRows = 64;
    const Tensor rows = at::empty({kRows, n}, at::TensorOptions().dtype(at::kFloat));
    float* v = rows.data_ptr<float>();
    uint64_t state = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(n);
    for (int64_t i = 0; i < kRows * n; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float mantissa = 1.0f + static_cast<float>((state >> 40) & 0xFFFFFF) / 16777216.0f;
      v[i] = std::ldexp(mantissa, static_cast<int>((state >> 20) % 13) - 6);
    }
    const Tensor want = at::sum(rows, {-1});
    int matching = 0;
    for (RowSum candidate : {RowSum{&torch_row_sum<16>}, RowSum{&torch_row_sum<8>}}) {
      bool same = true;
      for (int64_t r = 0; r < kRows && same; ++r) {
        const float got = candidate(v + r * n, n), expected = want.data_ptr<float>()[r];
        same = std::memcmp(&got, &expected, sizeof got) == 0;
      }
      if (same) {
        chosen = candidate;
        ++matching;
      }
    }
    if (matching != 1) chosen = nullptr;
  }
  known.emplace(n, chosen);
  last_n = n;
  return last = chosen;
}

// What both norm paths read and write, and the two element passes they share.
template <typename T>
struct NormRows {
  using IO = Io<T>;
  const typename IO::raw* xp;
  typename IO::raw* rp;          // residual + x (the residual output), or x itself
  const typename IO::raw* addp;  // the residual input, or nullptr (rms_norm)
  const typename IO::raw* wp;
  typename IO::raw* op;
  int64_t n;

  NormRows(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight, const Tensor& out,
           const Tensor& res)
      : xp(raw_ptr<T>(x)), rp(raw_mut<T>(res)), addp(residual.has_value() ? raw_ptr<T>(*residual) : nullptr),
        wp(raw_ptr<T>(weight)), op(raw_mut<T>(out)), n(x.size(1)) {}

  // Elements [lo, hi): the residual add rounded to T (stored), and its square in float into
  // sq[i - lo] (x.pow(2): torch squares by one multiply).
  void squares(int64_t lo, int64_t hi, float* sq) const {
    const int64_t first = lo;
#if defined(__AVX512F__)
    using V = Vec<T>;
    for (; lo + kLanes <= hi; lo += kLanes) {
      __m512 h;
      if (addp != nullptr) {
        h = V::store_rounded(rp + lo, _mm512_add_ps(V::load(addp + lo), V::load(xp + lo)));
      } else {
        h = V::load(xp + lo);
      }
      _mm512_storeu_ps(sq + lo - first, _mm512_mul_ps(h, h));
    }
#endif
    for (int64_t i = lo; i < hi; ++i) {
      float h;
      if (addp != nullptr) {  // residual + x in T, then its square in float
        const auto sum = IO::store(IO::load(addp[i]) + IO::load(xp[i]));
        rp[i] = sum;
        h = IO::load(sum);
      } else {
        h = IO::load(xp[i]);
      }
      sq[i - first] = h * h;
    }
  }

  // Row `row` of out: weight * (h * r).to(T), h the residual sum (or x), r = rsqrt(mean + eps)
  // from the row's sum of squares (torch.rsqrt(mean + eps): one true division, one square root).
  void normalise(int64_t row, float sum, float eps) const {
    const float r = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    const auto* h = (addp != nullptr ? rp : xp) + row * n;
    auto* o = op + row * n;
    int64_t j = 0;
#if defined(__AVX512F__)
    using V = Vec<T>;
    const __m512 rv = _mm512_set1_ps(r);
    for (; j + kLanes <= n; j += kLanes) {
      V::store(o + j, _mm512_mul_ps(V::load(wp + j), V::round(_mm512_mul_ps(V::load(h + j), rv))));
    }
#endif
    for (; j < n; ++j) o[j] = IO::store(IO::load(wp[j]) * round_to<T>(IO::load(h[j]) * r));
  }
};

// One row at a time where row_sum_for has a replica of torch's sum: the residual add and the
// squares (into a thread's row buffer), the sum, then the normalised row, all from L1.
template <typename T>
void rms_norm_rows(const NormRows<T>& norm, int64_t rows, float eps, RowSum row_sum) {
  const int64_t n = norm.n;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;
    if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(static_cast<size_t>(n));
    for (int64_t row = begin; row < end; ++row) {
      norm.squares(row * n, (row + 1) * n, buffer.data());
      norm.normalise(row, row_sum(buffer.data(), n), eps);
    }
  });
}

// Where no replica of torch's sum fits (rows narrower than a vector), at::sum sums the squares,
// kNormRows rows per pass. A prefill's [T, N] activations are tens of MB, so each pass over all
// of them (add and squares, torch's sum, normalise) went to memory; 256 rows of the default model
// (576 wide: 0.6 MB of float32 squares) stay in L2 across the three. torch's sum of a row does
// not depend on how many rows are summed with it (each row is one inner reduction), so the
// chunks change no bit. 2048 x 576 bf16 on one Xeon core: 1387-1563 -> 1062-1085 us.
constexpr int64_t kNormRows = 256;

template <typename T>
void rms_norm_impl(const NormRows<T>& norm, int64_t rows, float eps, const Tensor& squares, const Tensor& sums) {
  const int64_t n = norm.n;
  for (int64_t r0 = 0; r0 < rows; r0 += kNormRows) {
    const int64_t r1 = std::min(rows, r0 + kNormRows);
    float* sq = squares.data_ptr<float>();  // this chunk's rows: row r at sq[(r - r0) n]
    at::parallel_for(r0, r1, 16, [&](int64_t begin, int64_t end) {
      norm.squares(begin * n, end * n, sq + (begin - r0) * n);
    });
    // x.pow(2).mean(-1, keepdim=True): torch's mean of a float tensor on CPU is sum_out(...).div_(N),
    // so torch's own sum (its summation order) and one true division per row.
    Tensor chunk_sums = sums.narrow(0, r0, r1 - r0);
    at::sum_out(chunk_sums, squares.narrow(0, 0, r1 - r0), {-1});
    const float* vp = sums.data_ptr<float>();
    at::parallel_for(r0, r1, 16, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) norm.normalise(row, vp[row], eps);
    });
  }
}

std::tuple<Tensor, Tensor> norm_cpu(const Tensor& x, const std::optional<Tensor>& residual,
                                    const Tensor& weight, double eps) {
  check_norm(x, residual, weight);
  Tensor out = at::empty_like(x);
  Tensor res = residual.has_value() ? at::empty_like(x) : x;
  const float e = static_cast<float>(eps);
  const RowSum row_sum = row_sum_for(x.size(1));
  auto run = [&](auto norm) {
    if (row_sum != nullptr) {
      rms_norm_rows(norm, x.size(0), e, row_sum);
      return;
    }
    Tensor squares = at::empty({std::min(x.size(0), kNormRows), x.size(1)}, x.options().dtype(at::kFloat));
    Tensor sums = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
    rms_norm_impl(norm, x.size(0), e, squares, sums);
  };
  if (x.scalar_type() == at::kFloat) {
    run(NormRows<float>(x, residual, weight, out, res));
  } else {
    run(NormRows<c10::BFloat16>(x, residual, weight, out, res));
  }
  return {out, res};
}

#ifdef KVSENTRY_DEBUG_OPS
// The lanes of the row-sum replica the norms use for rows of n (16 or 8), 0 where they call at::sum.
int64_t norm_sum_lanes(int64_t n) {
  const RowSum chosen = row_sum_for(n);
  if (chosen == nullptr) return 0;
  return chosen == RowSum{&torch_row_sum<8>} ? 8 : 16;
}
#endif

Tensor rms_norm_cpu(const Tensor& x, const Tensor& weight, double eps) {
  return std::get<0>(norm_cpu(x, std::nullopt, weight, eps));
}

std::tuple<Tensor, Tensor> add_rms_norm_cpu(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                            double eps) {
  return norm_cpu(x, residual, weight, eps);
}

Tensor rms_norm_meta(const Tensor& x, const Tensor& weight, double eps) {
  check_norm(x, std::nullopt, weight);
  return at::empty_like(x);
}

std::tuple<Tensor, Tensor> add_rms_norm_meta(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                             double eps) {
  check_norm(x, residual, weight);
  return {at::empty_like(x), at::empty_like(x)};
}

void check_rotary(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin, const Tensor& positions) {
  constexpr const char* op = "kvsentry::rotary";
  TORCH_CHECK(fused_dtype(q.scalar_type()) && q.dim() == 3 && k.dim() == 3 && k.scalar_type() == q.scalar_type(),
              op, ": q and k must be float32 or bfloat16 [T, H, D] of one dtype");
  const int64_t d = q.size(2);
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == d && d % 2 == 0, op, ": q and k must share T and an even D");
  TORCH_CHECK((d == 0 || (q.stride(2) == 1 && k.stride(2) == 1)), op, ": q's and k's last dims must be contiguous");
  TORCH_CHECK((cos.scalar_type() == at::kFloat || cos.scalar_type() == q.scalar_type()) &&
                  sin.scalar_type() == cos.scalar_type() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(1) == d && cos.is_contiguous() && sin.is_contiguous(),
              op, ": cos and sin must be contiguous [P, D] tables, float32 or q's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == q.size(0), op,
              ": positions must be int64 [T]");
}

// One head: o = x * c + rotate_half(x) * s, rotate_half(x) = cat(-x2, x1); c and s are the
// position's table rows already rounded to T, and every product and sum rounds to T.
template <typename T>
void rotate(const typename Io<T>::raw* x, typename Io<T>::raw* o, const float* c, const float* s, int64_t half) {
  using IO = Io<T>;
  int64_t j = 0;
#if defined(__AVX512F__)
  using V = Vec<T>;
  for (; j + kLanes <= half; j += kLanes) {
    const __m512 a = V::load(x + j), b = V::load(x + j + half);
    const __m512 nb = _mm512_castsi512_ps(  // -b: the sign bit flipped, as the scalar negation
        _mm512_xor_si512(_mm512_castps_si512(b), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
    V::store(o + j, _mm512_add_ps(V::round(_mm512_mul_ps(a, _mm512_loadu_ps(c + j))),
                                  V::round(_mm512_mul_ps(nb, _mm512_loadu_ps(s + j)))));
    V::store(o + j + half, _mm512_add_ps(V::round(_mm512_mul_ps(b, _mm512_loadu_ps(c + j + half))),
                                         V::round(_mm512_mul_ps(a, _mm512_loadu_ps(s + j + half)))));
  }
#endif
  for (; j < half; ++j) {
    const float a = IO::load(x[j]), b = IO::load(x[j + half]);
    o[j] = IO::store(round_to<T>(a * c[j]) + round_to<T>(-b * s[j]));
    o[j + half] = IO::store(round_to<T>(b * c[j + half]) + round_to<T>(a * s[j + half]));
  }
}

template <typename T, typename C>
void rotary_impl(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                 const Tensor& q_out, const Tensor& k_out) {
  const int64_t tokens = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2), half = d / 2;
  const int64_t table = cos.size(0);
  const Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(0 <= pp[t] && pp[t] < table, "kvsentry::rotary: position ", pp[t], " out of range [0, ", table, ")");
  }
  const auto* qp = raw_ptr<T>(q);
  const auto* kp = raw_ptr<T>(k);
  auto* qo = raw_mut<T>(q_out);
  auto* ko = raw_mut<T>(k_out);
  const auto* cp = raw_ptr<C>(cos);
  const auto* sp = raw_ptr<C>(sin);
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> c(d), s(d);
    for (int64_t t = begin; t < end; ++t) {
      const auto* crow = cp + pp[t] * d;
      const auto* srow = sp + pp[t] * d;
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + kLanes <= d; j += kLanes) {  // cos[pos].to(dtype), 16 at a time
        _mm512_storeu_ps(c.data() + j, Vec<T>::round(Vec<C>::load(crow + j)));
        _mm512_storeu_ps(s.data() + j, Vec<T>::round(Vec<C>::load(srow + j)));
      }
#endif
      for (; j < d; ++j) {  // cos[pos].to(dtype)
        c[j] = round_to<T>(Io<C>::load(crow[j]));
        s[j] = round_to<T>(Io<C>::load(srow[j]));
      }
      for (int64_t h = 0; h < hq; ++h) {
        rotate<T>(qp + t * q.stride(0) + h * q.stride(1), qo + (t * hq + h) * d, c.data(), s.data(), half);
      }
      for (int64_t h = 0; h < hk; ++h) {
        rotate<T>(kp + t * k.stride(0) + h * k.stride(1), ko + (t * hk + h) * d, c.data(), s.data(), half);
      }
    }
  });
}

std::tuple<Tensor, Tensor> rotary_cpu(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                      const Tensor& positions) {
  check_rotary(q, k, cos, sin, positions);
  Tensor q_out = at::empty(q.sizes(), q.options());
  Tensor k_out = at::empty(k.sizes(), k.options());
  if (q.scalar_type() == at::kFloat) {
    rotary_impl<float, float>(q, k, cos, sin, positions, q_out, k_out);
  } else if (cos.scalar_type() == at::kFloat) {
    rotary_impl<c10::BFloat16, float>(q, k, cos, sin, positions, q_out, k_out);
  } else {
    rotary_impl<c10::BFloat16, c10::BFloat16>(q, k, cos, sin, positions, q_out, k_out);
  }
  return {q_out, k_out};
}

std::tuple<Tensor, Tensor> rotary_meta(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                       const Tensor& positions) {
  check_rotary(q, k, cos, sin, positions);
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options())};
}

void check_silu(const Tensor& gate_up) {
  TORCH_CHECK(fused_dtype(gate_up.scalar_type()) && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
                  (gate_up.size(1) == 0 || gate_up.stride(1) == 1),
              "kvsentry::silu_and_mul: gate_up must be float32 or bfloat16 [T, 2 I] with a contiguous last dim");
}

#if defined(__AVX512F__)
// torch's own vector exp: ATen's Vectorized<float>::exp() is Sleef_expf16_u10, which
// libtorch_cpu exports. Found at load time in the library that defines at::silu_out, so a
// torch without it (another build) leaves this null and the op falls back to at::silu_out.
using VectorExp = __m512 (*)(__m512);
VectorExp torch_vector_exp() {
  static const VectorExp fn = [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&at::_ops::silu_out::call), &info) == 0 || info.dli_fname == nullptr) {
      return VectorExp{nullptr};
    }
    void* lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    return lib == nullptr ? VectorExp{nullptr} : reinterpret_cast<VectorExp>(dlsym(lib, "Sleef_expf16_u10"));
  }();
  return fn;
}

// silu(x) = x / (1 + exp(-x)) in float, rounded to bf16, for each of the 65,536 bf16 inputs x,
// indexed by x's bits, plus one entry of padding (a 32-bit gather at the last index reads two
// bytes past it). The exp is the inline one, which gives Sleef's SiLU bits (torch's vector
// body's) for every bf16 input (see cpu_fast_exp.h).
//
// Why: a bf16 gate has only 2^16 values, and torch rounds silu(gate) to bf16 before the
// product, so the SiLU is a pure function of the gate's bits. One gather from this table
// replaces an exp and a division (~19 cycles a vector of 16, the divider bound); the gates of
// a layer's rows fall in a few exponents, so the lines they touch stay in L1. Where gathers are
// slow (AMD's cores) the vector body computes the same bits instead (silu_quotient).
const uint16_t* bf16_silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65536 + 2);
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    alignas(64) uint16_t gates[kLanes];
    for (int64_t base = 0; base < 65536; base += kLanes) {
      for (int64_t k = 0; k < kLanes; ++k) gates[k] = static_cast<uint16_t>(base + k);
      using V = Vec<c10::BFloat16>;
      const __m512 x = V::load(gates);
      const __m512 e = kvsentry_math::fast_exp_ps(_mm512_xor_ps(x, sign));
      V::store(t.data() + base, _mm512_div_ps(x, _mm512_add_ps(one, e)));
    }
    return t;
  }();
  return table.data();
}

// Which bf16 SiLU the vector body runs: the table's gather on Intel cores (it was ~4% of a
// prefill step on a Xeon with AMX, against the divider), the computed quotient elsewhere (on a
// Zen 5 EPYC core silu_and_mul over 2048 x 1536 took 1.66-1.68 cycles an element through the
// gather, 1.09-1.11 computed by silu_quotient and silu_vectors).
// The bits are the same either way; the test build's kvsentry_debug.silu_table picks one, so
// that one CPU checks both.
#ifdef KVSENTRY_DEBUG_OPS
std::atomic<int> g_silu_table{-1};  // -1: by the CPU; 0: computed; 1: the table
#endif
bool silu_by_table() {
  static const bool intel = __builtin_cpu_is("intel");
#ifdef KVSENTRY_DEBUG_OPS
  const int forced = g_silu_table.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
#endif
  return intel;
}

// x / d as vdivps rounds it, for the bf16 SiLU's d = 1 + exp(-x) in [1, 2^100) and |x| < 2^100:
// a reciprocal estimate, one Newton step, the quotient, and one correction by its exact remainder
// (fused multiply-adds), where vdivps bounded the SiLU (~19 cycles a vector of 16). Lanes outside
// that range (x below about -69, infinities, NaN) take vdivps. The bf16 SiLU has torch's bits for every one of the 65,536 bf16 gates
// (tests/csrc/test_fused_ops.py checks each): only the bf16 result is promised, not the float
// quotient's last bit. On a Zen 5 the estimate alone already rounds to the same bf16 for every
// gate; the Newton step and the correction are there because vrcp14ps's bits are the vendor's
// (only its error bound is specified), and with them the quotient is within an ulp of vdivps's
// whichever table the CPU has.
inline __m512 silu_quotient(__m512 x, __m512 d) {
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, one), r);
  __m512 q = _mm512_mul_ps(x, r);
  q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, d, x), r, q);
  // x's sign onto q: the correction turns x = -0's quotient into +0 (-0 - -0 is +0); every other
  // q already has x's sign (d > 0). One ternary logic op: q | (x & sign bit).
  q = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(q), _mm512_castps_si512(x),
                                                    _mm512_set1_epi32(INT32_MIN), 0xF8));
  const __m512 limit = _mm512_set1_ps(0x1p100f);
  const __mmask16 inside = _mm512_cmp_ps_mask(d, limit, _CMP_LT_OQ) &
                           _mm512_cmp_ps_mask(_mm512_abs_ps(x), limit, _CMP_LT_OQ);
  if (__builtin_expect(inside != 0xFFFF, 0)) q = _mm512_mask_div_ps(q, static_cast<__mmask16>(~inside), x, d);
  return q;
}

// out[0, 16 N) = round(silu(gate)) * up for N vectors of bf16, stage by stage across them: N
// independent chains side by side. One vector at a time waited out each multiply-add's latency
// (the store between vectors may alias the next loads, as far as the compiler knows).
template <int64_t N>
inline void silu_vectors(const uint16_t* g, const uint16_t* u, uint16_t* o) {
  using V = Vec<c10::BFloat16>;
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  __m512 x[N], d[N];
  for (int64_t k = 0; k < N; ++k) x[k] = V::load(g + k * kLanes);
  for (int64_t k = 0; k < N; ++k) d[k] = _mm512_add_ps(one, kvsentry_math::fast_exp_ps(_mm512_xor_ps(x[k], sign)));
  for (int64_t k = 0; k < N; ++k) x[k] = silu_quotient(x[k], d[k]);
  for (int64_t k = 0; k < N; ++k) V::store(o + k * kLanes, _mm512_mul_ps(V::round(x[k]), V::load(u + k * kLanes)));
}

// out = silu(gate) * up in one pass, with torch's bits: the SiLU as ATen's CPU kernel
// computes it (x / (1 + exp(-x)) in float, rounded to T), then the product in float, rounded
// to T. ATen's elementwise loop runs its vector body over 2 vectors of T at a time (64 bf16
// or 32 float elements) and the rest of each row through the scalar formula with std::exp;
// the chunking below is the same, so every element takes the path (and exp) it takes there.
template <typename T>
void silu_mul_impl(const Tensor& gate_up, const Tensor& out) {
  using IO = Io<T>;
  const int64_t rows = out.size(0), n = out.size(1);
  const auto* gp = raw_ptr<T>(gate_up);
  auto* op = raw_mut<T>(out);
  const int64_t g_stride = gate_up.stride(0);
  const VectorExp vexp = torch_vector_exp();
  const uint16_t* silu = std::is_same_v<T, c10::BFloat16> && silu_by_table() ? bf16_silu_table() : nullptr;
  constexpr int64_t chunk = std::is_same_v<T, float> ? 2 * kLanes : 4 * kLanes;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const auto* g = gp + row * g_stride;
      const auto* u = g + n;
      auto* o = op + row * n;
      int64_t j = 0;
      using V = Vec<T>;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        // The vector body's SiLU from bf16_silu_table, or computed as the table was: the inline
        // exp, which gives Sleef's SiLU bits (torch's vector body's) for every bf16 input (see
        // cpu_fast_exp.h), and silu_quotient's division, two of ATen's chunks a pass where the
        // row has them (each element's path is the same).
        if (silu != nullptr) {
          for (; j + chunk <= n; j += chunk) {
            for (int64_t k = 0; k < chunk / kLanes; ++k) {
              const auto* gates = reinterpret_cast<const __m256i*>(g + j + k * kLanes);
              const __m512i index = _mm512_cvtepu16_epi32(_mm256_loadu_si256(gates));
              const __m512i s = _mm512_i32gather_epi32(index, silu, 2);  // the entry in each lane's low half
              const __m512 sf = _mm512_castsi512_ps(_mm512_slli_epi32(s, 16));
              V::store(o + j + k * kLanes, _mm512_mul_ps(sf, V::load(u + j + k * kLanes)));
            }
          }
        } else {
          for (; j + 2 * chunk <= n; j += 2 * chunk) silu_vectors<2 * chunk / kLanes>(g + j, u + j, o + j);
          for (; j + chunk <= n; j += chunk) silu_vectors<chunk / kLanes>(g + j, u + j, o + j);
        }
      } else {
        const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
        for (; j + chunk <= n; j += chunk) {
          // torch's own exps first (opaque calls), then the independent divisions of the
          // whole chunk, which the core overlaps: one vector at a time waited on each.
          __m512 e[chunk / kLanes];
          for (int64_t k = 0; k < chunk / kLanes; ++k) e[k] = vexp(_mm512_xor_ps(V::load(g + j + k * kLanes), sign));
          for (int64_t k = 0; k < chunk / kLanes; ++k) {
            const __m512 x = V::load(g + j + k * kLanes);
            const __m512 s = V::round(_mm512_div_ps(x, _mm512_add_ps(one, e[k])));
            V::store(o + j + k * kLanes, _mm512_mul_ps(s, V::load(u + j + k * kLanes)));
          }
        }
      }
      for (; j < n; ++j) {
        const float x = IO::load(g[j]);
        o[j] = IO::store(round_to<T>(x / (1.0f + std::exp(-x))) * IO::load(u[j]));
      }
    }
  });
}
#endif  // __AVX512F__

Tensor silu_and_mul_cpu(const Tensor& gate_up) {
  check_silu(gate_up);
  const int64_t n = gate_up.size(1) / 2;
  Tensor out = at::empty({gate_up.size(0), n}, gate_up.options());
#if defined(__AVX512F__)
  if (torch_vector_exp() != nullptr) {
    if (gate_up.scalar_type() == at::kFloat) {
      silu_mul_impl<float>(gate_up, out);
    } else {
      silu_mul_impl<c10::BFloat16>(gate_up, out);
    }
    return out;
  }
#endif
  // No torch exp to call, or a build whose torch vector body uses another exp (AVX2 or none):
  // torch's own kernel into out, then the product in place.
  at::silu_out(out, gate_up.narrow(1, 0, n));
  out.mul_(gate_up.narrow(1, n, n));
  return out;
}

Tensor silu_and_mul_meta(const Tensor& gate_up) {
  check_silu(gate_up);
  return at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor positions) -> (Tensor, Tensor)");
}

#ifdef KVSENTRY_DEBUG_OPS
// kvsentry_debug.silu_table: True runs the bf16 SiLU from its table, False computes it, None goes
// back to the CPU's choice; returns whether the table runs now (AVX-512 builds; else False).
namespace {
bool silu_table(std::optional<bool> use) {
#if defined(__AVX512F__)
  g_silu_table.store(use.has_value() ? static_cast<int>(*use) : -1);
  return silu_by_table();
#else
  return false;
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry_debug, m) {
  m.def("norm_sum_lanes(int n) -> int", &norm_sum_lanes);
  m.def("silu_table(bool? use=None) -> bool", &silu_table);
}
#endif

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("rotary", &rotary_cpu);
  m.impl("silu_and_mul", &silu_and_mul_cpu);
}

TORCH_LIBRARY_IMPL(kvsentry, Meta, m) {
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("add_rms_norm", &add_rms_norm_meta);
  m.impl("rotary", &rotary_meta);
  m.impl("silu_and_mul", &silu_and_mul_meta);
}
