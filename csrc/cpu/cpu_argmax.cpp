// Greedy sampling's argmax over the logits rows, on CPU, in the logits' own dtype:
//
//   tokens, finite = torch.ops.kvsentry.row_argmax(logits)
//     logits  [n, vocab] float32 or bfloat16, a contiguous last dim (rows any stride)
//     tokens  [n] int64: torch.argmax(logits, -1) exactly -- the first maximum, and where a
//             row holds a NaN, its first NaN (torch's max lets NaN win)
//     finite  [n] bool: the row holds no NaN and no infinity (the sentinel's logits check)
//
// Why: a greedy step used to copy the bf16 logits to float32 (12.6 MB at 64 rows of a
// 49152-token vocabulary) and run two torch reductions over them (engine/worker/sampler.py's
// row_argmax) and a third (the finiteness sum, engine/worker/model_runner.py): ~4 ms of a ~90
// ms batch-64 decode step on a 1-core Xeon. Here each row is read once, 16 values per compare,
// for both answers. bf16 -> float is exact, so they are the float ones.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

namespace {

using at::Tensor;
constexpr const char* kOp = "kvsentry::row_argmax";
constexpr int kUnroll = 4;  // vectors of 16 per step of the vector body

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// The scalar definition: the first NaN, else the first maximum; `finite` is cleared by a NaN
// or an infinity. Returns the NaN's position, or -1.
template <typename T>
int64_t argmax_scalar(const T* row, int64_t begin, int64_t end, int64_t& best_i, float& best, bool& finite) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = to_float(row[i]);
    if (std::isnan(v)) {
      finite = false;
      return i;
    }
    finite = finite && !std::isinf(v);
    if (v > best) {
      best = v;
      best_i = i;
    }
  }
  return -1;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

template <typename T>
int64_t row_argmax(const T* row, int64_t vocab, bool& finite) {
  int64_t best_i = 0;
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  finite = true;
#if defined(__AVX512F__)
  if (vocab >= kUnroll * 16) {
    // Accumulator k, lane l keeps the first maximum of positions 64 j + 16 k + l; the row's first
    // maximum is the smallest position among those holding the largest value. Four accumulators:
    // with one, each 16 values waited on the previous compare and select (a ~5-cycle chain):
    // 64 rows x 49152 bf16 from L2/L3 on one Xeon core 411 -> 290 us.
    // NaNs and infinities are only noted (one class test); a row that has one is looked at again.
    __m512 lane_best[kUnroll];
    __m512i lane_pos[kUnroll];
    for (int k = 0; k < kUnroll; ++k) {
      lane_best[k] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      lane_pos[k] = _mm512_setzero_si512();  // an all -inf row: lane l of accumulator 0, position 0, wins
    }
    __m512i base = _mm512_setzero_si512();  // 64 j in every lane
    const __m512i step = _mm512_set1_epi32(kUnroll * 16);
    __mmask16 special = 0;
    for (; i + kUnroll * 16 <= vocab; i += kUnroll * 16) {
      for (int k = 0; k < kUnroll; ++k) {
        const __m512 v = load16(row + i + 16 * k);
        special |= _mm512_fpclass_ps_mask(v, 0x99);  // QNaN, +inf, -inf, SNaN
        const __mmask16 better = _mm512_cmp_ps_mask(v, lane_best[k], _CMP_GT_OQ);
        lane_best[k] = _mm512_mask_mov_ps(lane_best[k], better, v);
        lane_pos[k] = _mm512_mask_mov_epi32(lane_pos[k], better, base);
      }
      base = _mm512_add_epi32(base, step);
    }
    if (special != 0) {
      finite = false;
      for (int64_t j = 0; j < i; ++j) {
        if (std::isnan(to_float(row[j]))) return j;
      }
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 top = lane_best[0];
    for (int k = 1; k < kUnroll; ++k) top = _mm512_max_ps(top, lane_best[k]);
    best = _mm512_reduce_max_ps(top);
    const __m512 best_v = _mm512_set1_ps(best);
    best_i = std::numeric_limits<int32_t>::max();
    for (int k = 0; k < kUnroll; ++k) {
      const __mmask16 at_best = _mm512_cmp_ps_mask(lane_best[k], best_v, _CMP_EQ_OQ);
      const __m512i pos = _mm512_add_epi32(lane_pos[k], _mm512_add_epi32(lane, _mm512_set1_epi32(16 * k)));
      if (at_best != 0) best_i = std::min<int64_t>(best_i, _mm512_mask_reduce_min_epi32(at_best, pos));
    }
  }
#endif
  const int64_t nan_at = argmax_scalar(row, i, vocab, best_i, best, finite);
  return nan_at >= 0 ? nan_at : best_i;
}

std::tuple<Tensor, Tensor> row_argmax_cpu(const Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              kOp, ": logits must be a CPU float32 or bfloat16 [n, vocab] tensor with a contiguous last dim");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31), kOp, ": vocab must be in [1, 2^31)");
  const int64_t n = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  Tensor out = at::empty({n}, logits.options().dtype(at::kLong));
  Tensor finite = at::empty({n}, logits.options().dtype(at::kBool));
  int64_t* o = out.data_ptr<int64_t>();
  bool* f = finite.data_ptr<bool>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (logits.scalar_type() == at::kFloat) {
        o[r] = row_argmax(logits.data_ptr<float>() + r * stride, vocab, f[r]);
      } else {
        o[r] = row_argmax(logits.data_ptr<c10::BFloat16>() + r * stride, vocab, f[r]);
      }
    }
  });
  return {out, finite};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) { m.def("row_argmax(Tensor logits) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) { m.impl("row_argmax", &row_argmax_cpu); }
