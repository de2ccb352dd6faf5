// The NaN sentinel's scan on CPU: non-finite values per (block, layer) of the paged KV cache.
//
//   out = torch.ops.kvsentry.kv_block_nonfinite(words, block_ids, kind)
//
//   words      int32 [num_blocks, num_layers, chunks, chunk_words], the cache's bytes as
//              32-bit words (engine/ops/checksum.py's block_words view; last dim contiguous)
//   block_ids  int64 [n]
//   kind       what the words hold: 0 float32, 1 bfloat16, 2 float16, 3 float8_e4m3fn
//   out        int64 [n, num_layers]: how many values are NaN or +-Inf
//
// A value is non-finite exactly when its exponent bits are all ones (e4m3fn has no Inf:
// its NaN is S.1111.111). Integer masks and compares on the raw words, vectorised, one
// pass over memory and no float conversion: a strided bf16 view summed in float32 by torch
// copies the whole window first. engine/ops/nonfinite.py holds the torch reference;
// tests/csrc/test_nonfinite.py holds the two equal.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

using at::Tensor;
constexpr const char* kOp = "kvsentry::kv_block_nonfinite";

template <int kKind>
inline uint32_t nonfinite_in_word(uint32_t w) {
  if constexpr (kKind == 0) {
    return (w & 0x7F800000u) == 0x7F800000u;
  } else if constexpr (kKind == 1) {
    return ((w & 0x7F80u) == 0x7F80u) + ((w & 0x7F800000u) == 0x7F800000u);
  } else if constexpr (kKind == 2) {
    return ((w & 0x7C00u) == 0x7C00u) + ((w & 0x7C000000u) == 0x7C000000u);
  } else {
    return ((w & 0x7Fu) == 0x7Fu) + ((w & 0x7F00u) == 0x7F00u) + ((w & 0x7F0000u) == 0x7F0000u) +
           ((w & 0x7F000000u) == 0x7F000000u);
  }
}

template <int kKind>
void count(const Tensor& words, const int64_t* id, int64_t n, int64_t* o) {
  const int64_t num_layers = words.size(1), chunks = words.size(2), chunk_words = words.size(3);
  const auto* base = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>());
  const int64_t s0 = words.stride(0), s1 = words.stride(1), s2 = words.stride(2);
  at::parallel_for(0, n * num_layers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint32_t* layer = base + id[t / num_layers] * s0 + (t % num_layers) * s1;
      uint32_t found = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint32_t* w = layer + c * s2;
        // The chunks of a block lie far apart (one per layer, K/V and head in the CPU layout):
        // ask for the next one while this one is counted, or every chunk starts with a miss.
        const uint32_t* next = c + 1 < chunks ? w + s2 : (t + 1 < end ? base + id[(t + 1) / num_layers] * s0 +
                                                                            ((t + 1) % num_layers) * s1
                                                                      : nullptr);
        if (next != nullptr) {
          for (int64_t jj = 0; jj < chunk_words; jj += 16) __builtin_prefetch(next + jj);
        }
        int64_t j = 0;
#if defined(__AVX512BW__)
        if constexpr (kKind == 1) {  // bf16: 32 values per compare, an all-ones exponent is inf or NaN
          const __m512i exponent = _mm512_set1_epi16(0x7F80);
          for (; j + 16 <= chunk_words; j += 16) {
            const __m512i v = _mm512_and_si512(_mm512_loadu_si512(w + j), exponent);
            found += static_cast<uint32_t>(__builtin_popcount(_mm512_cmpeq_epi16_mask(v, exponent)));
          }
        }
#endif
        for (; j < chunk_words; ++j) found += nonfinite_in_word<kKind>(w[j]);
      }
      o[t] = found;
    }
  });
}

void check(const Tensor& words, const Tensor& block_ids, int64_t kind) {
  TORCH_CHECK(words.scalar_type() == at::kInt && words.dim() == 4, kOp,
              ": words must be int32 [num_blocks, num_layers, chunks, chunk_words]");
  TORCH_CHECK(words.size(3) == 0 || words.stride(3) == 1, kOp, ": words' last dim must be contiguous");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1, kOp, ": block_ids must be int64 [n]");
  TORCH_CHECK(0 <= kind && kind <= 3, kOp, ": kind must be 0 (float32), 1 (bfloat16), 2 (float16) or 3 (fp8 e4m3fn)");
}

Tensor kv_block_nonfinite_cpu(const Tensor& words, const Tensor& block_ids, int64_t kind) {
  check(words, block_ids, kind);
  const int64_t n = block_ids.size(0);
  Tensor out = at::empty({n, words.size(1)}, words.options().dtype(at::kLong));
  const Tensor ids = block_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= id[i] && id[i] < words.size(0), kOp, ": block id ", id[i], " out of range");
  }
  int64_t* o = out.data_ptr<int64_t>();
  switch (kind) {
    case 0: count<0>(words, id, n, o); break;
    case 1: count<1>(words, id, n, o); break;
    case 2: count<2>(words, id, n, o); break;
    default: count<3>(words, id, n, o); break;
  }
  return out;
}

Tensor kv_block_nonfinite_meta(const Tensor& words, const Tensor& block_ids, int64_t kind) {
  check(words, block_ids, kind);
  return at::empty({block_ids.size(0), words.size(1)}, words.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("kv_block_nonfinite(Tensor words, Tensor block_ids, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) { m.impl("kv_block_nonfinite", &kv_block_nonfinite_cpu); }

TORCH_LIBRARY_IMPL(kvsentry, Meta, m) { m.impl("kv_block_nonfinite", &kv_block_nonfinite_meta); }
