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
// Both reproduce the Hugging Face modules (LlamaRMSNorm, apply_rotary_pos_emb) bit for bit:
// every elementwise op rounds to its dtype exactly where torch's would (bf16 ops compute in
// float and round once), there is no FMA contraction (the pragma below), and the one
// reduction, the mean of squares, is at::mean itself over the same float32 [T, N] tensor
// that x.pow(2) gives, so its summation order is torch's. The torch references
// (engine/ops/fused_ops.py) define the results; tests/csrc/test_fused_ops.py holds the
// kernels to them bit for bit.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mean.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

namespace {

using at::Tensor;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
// Round a float to T (round to nearest even for bf16, as torch's conversions do).
template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

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

template <typename T>
void rms_norm_impl(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight, float eps,
                   const Tensor& out, const Tensor& res, const Tensor& squares) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = res.data_ptr<T>();
  float* sq = squares.data_ptr<float>();
  const T* addp = residual.has_value() ? residual->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * n; i < end * n; ++i) {
      float h;
      if (addp != nullptr) {
        const T sum = round_to<T>(to_float(addp[i]) + to_float(xp[i]));
        rp[i] = sum;
        h = to_float(sum);
      } else {
        h = to_float(xp[i]);
      }
      sq[i] = h * h;  // x.pow(2): torch squares by one multiply
    }
  });
  // x.pow(2).mean(-1, keepdim=True): torch's own reduction, so the same summation order.
  const Tensor var = at::mean(squares, {-1}, /*keepdim=*/true);
  const float* vp = var.data_ptr<float>();
  const T* wp = weight.data_ptr<T>();
  const T* hp = residual.has_value() ? rp : xp;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float r = 1.0f / std::sqrt(vp[row] + eps);  // torch.rsqrt(var + eps)
      const T* h = hp + row * n;
      T* o = op + row * n;
      for (int64_t j = 0; j < n; ++j) {
        const T normed = round_to<T>(to_float(h[j]) * r);        // (x * r).to(dtype)
        o[j] = round_to<T>(to_float(wp[j]) * to_float(normed));  // weight * ...
      }
    }
  });
}

std::tuple<Tensor, Tensor> norm_cpu(const Tensor& x, const std::optional<Tensor>& residual,
                                    const Tensor& weight, double eps) {
  check_norm(x, residual, weight);
  Tensor out = at::empty_like(x);
  Tensor res = residual.has_value() ? at::empty_like(x) : x;
  Tensor squares = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x, residual, weight, static_cast<float>(eps), out, res, squares);
  } else {
    rms_norm_impl<c10::BFloat16>(x, residual, weight, static_cast<float>(eps), out, res, squares);
  }
  return {out, res};
}

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

template <typename T, typename C>
void rotate(const T* x, T* o, const C* cp, const C* sp, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {  // the table's values rounded to T: cos[pos].to(dtype)
    const T c0 = round_to<T>(to_float(cp[j])), c1 = round_to<T>(to_float(cp[j + half]));
    const T s0 = round_to<T>(to_float(sp[j])), s1 = round_to<T>(to_float(sp[j + half]));
    const float a = to_float(x[j]), b = to_float(x[j + half]);
    // x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1); each op rounds to T
    const T lo_c = round_to<T>(a * to_float(c0)), lo_s = round_to<T>(-b * to_float(s0));
    const T hi_c = round_to<T>(b * to_float(c1)), hi_s = round_to<T>(a * to_float(s1));
    o[j] = round_to<T>(to_float(lo_c) + to_float(lo_s));
    o[j + half] = round_to<T>(to_float(hi_c) + to_float(hi_s));
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
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  T* ko = k_out.data_ptr<T>();
  const C* cp = cos.data_ptr<C>();
  const C* sp = sin.data_ptr<C>();
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* c = cp + pp[t] * d;
      const C* s = sp + pp[t] * d;
      for (int64_t h = 0; h < hq; ++h) {
        rotate<T, C>(qp + t * q.stride(0) + h * q.stride(1), qo + (t * hq + h) * d, c, s, half);
      }
      for (int64_t h = 0; h < hk; ++h) {
        rotate<T, C>(kp + t * k.stride(0) + h * k.stride(1), ko + (t * hk + h) * d, c, s, half);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor positions) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("rotary", &rotary_cpu);
}

TORCH_LIBRARY_IMPL(kvsentry, Meta, m) {
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("add_rms_norm", &add_rms_norm_meta);
  m.impl("rotary", &rotary_meta);
}
