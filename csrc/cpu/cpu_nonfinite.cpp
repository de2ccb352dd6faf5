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
//   total = torch.ops.kvsentry.kv_block_nonfinite_into(words, [ids...], kind, out)
//
//   the same counts into out[:n] (a reused int64 [>= n, num_layers]), and their sum
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
#include <vector>
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
inline uint32_t count_chunk(const uint32_t* w, int64_t chunk_words) {
  uint32_t found = 0;
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
  return found;
}

// One unit of work: a run of consecutive block ids (ids[first], ids[first] + 1, ...) in one layer.
struct Run {
  int64_t first;  // index into block_ids (and out's rows) of the run's first block
  int64_t length;
};

template <int kKind>
void count(const Tensor& words, const int64_t* id, int64_t n, int64_t* o) {
  const int64_t num_layers = words.size(1), chunks = words.size(2), chunk_words = words.size(3);
  const auto* base = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>());
  const int64_t s0 = words.stride(0), s1 = words.stride(1), s2 = words.stride(2);
  // A block's chunks lie far apart (one per layer, K/V and head in the CPU layout), so a cold
  // scan pays a memory (and, in a VM, a nested page-walk) latency per chunk. Consecutive blocks
  // are adjacent within a chunk (the rolling sweep's window), so a run of them is read as one
  // stream per chunk: 5 blocks as null block + a 4-block window are 360 streams, not 900.
  std::vector<Run> runs;
  for (int64_t i = 0; i < n;) {
    int64_t j = i + 1;
    while (j < n && id[j] == id[j - 1] + 1 && s0 == chunk_words) ++j;
    runs.push_back({i, j - i});
    i = j;
  }
  const int64_t num_runs = static_cast<int64_t>(runs.size());
  for (int64_t i = 0; i < n * num_layers; ++i) o[i] = 0;
  // Stream q = (unit, chunk), unit = run * num_layers + layer: one contiguous run of words.
  auto stream = [&](int64_t q) {
    const int64_t unit = q / chunks;
    return base + id[runs[unit / num_layers].first] * s0 + (unit % num_layers) * s1 + (q % chunks) * s2;
  };
  auto stream_words = [&](int64_t q) { return runs[q / chunks / num_layers].length * chunk_words; };
  // One stream ahead: deeper prefetching (4, 16) measured no faster in the engine, where the
  // cost is a page walk per stream that a prefetch does not hide.
  constexpr int64_t kAhead = 1;
  constexpr int64_t kGroup = 64;  // streams touched at once: 16 and 256 measured the same
  if (chunk_words == 0) return;
  // Threads split whole units: two threads never add into the same (block, layer) count.
  at::parallel_for(0, num_runs * num_layers, 1, [&](int64_t first_unit, int64_t last_unit) {
    const int64_t begin = first_unit * chunks, end = last_unit * chunks;
    for (int64_t g = begin; g < end; g += kGroup) {
      const int64_t g_end = std::min(g + kGroup, end);
      // A plain load of each stream's first word, all independent: the out-of-order core runs
      // their misses and page walks side by side, where prefetches alone did not (the null
      // block's 180 streams: ~200 -> ~130 us cold, in the engine, on the development VM).
      uint32_t sink = 0;
      for (int64_t q = g; q < g_end; ++q) sink += *stream(q);
      asm volatile("" : : "r"(sink));
      for (int64_t q = g; q < g_end; ++q) {
        if (q + kAhead < g_end) {
          const uint32_t* next = stream(q + kAhead);
          for (int64_t jj = 0, nw = stream_words(q + kAhead); jj < nw; jj += 16) __builtin_prefetch(next + jj);
        }
        const uint32_t* w = stream(q);
        const int64_t unit = q / chunks, layer = unit % num_layers;
        const Run& run = runs[unit / num_layers];
        for (int64_t b = 0; b < run.length; ++b) {
          o[(run.first + b) * num_layers + layer] += count_chunk<kKind>(w + b * s0, chunk_words);
        }
      }
    }
  });
}

void check(const Tensor& words, int64_t kind) {
  TORCH_CHECK(words.scalar_type() == at::kInt && words.dim() == 4, kOp,
              ": words must be int32 [num_blocks, num_layers, chunks, chunk_words]");
  TORCH_CHECK(words.size(3) == 0 || words.stride(3) == 1, kOp, ": words' last dim must be contiguous");
  TORCH_CHECK(0 <= kind && kind <= 3, kOp, ": kind must be 0 (float32), 1 (bfloat16), 2 (float16) or 3 (fp8 e4m3fn)");
}

// Counts into out's first n rows ([n, num_layers] int64, contiguous); returns their sum.
int64_t count_into(const Tensor& words, const int64_t* id, int64_t n, int64_t kind, int64_t* o) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= id[i] && id[i] < words.size(0), kOp, ": block id ", id[i], " out of range");
  }
  switch (kind) {
    case 0: count<0>(words, id, n, o); break;
    case 1: count<1>(words, id, n, o); break;
    case 2: count<2>(words, id, n, o); break;
    default: count<3>(words, id, n, o); break;
  }
  int64_t total = 0;
  for (int64_t i = 0; i < n * words.size(1); ++i) total += o[i];
  return total;
}

Tensor kv_block_nonfinite_cpu(const Tensor& words, const Tensor& block_ids, int64_t kind) {
  check(words, kind);
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1, kOp, ": block_ids must be int64 [n]");
  const int64_t n = block_ids.size(0);
  Tensor out = at::empty({n, words.size(1)}, words.options().dtype(at::kLong));
  const Tensor ids = block_ids.contiguous();
  count_into(words, ids.data_ptr<int64_t>(), n, kind, out.data_ptr<int64_t>());
  return out;
}

// The sentinel's per-step form: ids as a plain list and a reused output, so a step costs one
// dispatch and no tensor allocations (each torch op after a forward pass runs with cold caches:
// ~40-70 us apiece on the development machines). Returns the total, which is 0 on a clean cache.
int64_t kv_block_nonfinite_into_cpu(const Tensor& words, at::IntArrayRef block_ids, int64_t kind, const Tensor& out) {
  check(words, kind);
  const int64_t n = static_cast<int64_t>(block_ids.size());
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 2 && out.is_contiguous() && out.size(0) >= n &&
                  out.size(1) == words.size(1),
              kOp, "_into: out must be contiguous int64 [>= n, num_layers]");
  return count_into(words, block_ids.data(), n, kind, out.data_ptr<int64_t>());
}

Tensor kv_block_nonfinite_meta(const Tensor& words, const Tensor& block_ids, int64_t kind) {
  check(words, kind);
  return at::empty({block_ids.size(0), words.size(1)}, words.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("kv_block_nonfinite(Tensor words, Tensor block_ids, int kind) -> Tensor");
  m.def("kv_block_nonfinite_into(Tensor words, int[] block_ids, int kind, Tensor(a!) out) -> int");
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) {
  m.impl("kv_block_nonfinite", &kv_block_nonfinite_cpu);
  m.impl("kv_block_nonfinite_into", &kv_block_nonfinite_into_cpu);
}

TORCH_LIBRARY_IMPL(kvsentry, Meta, m) { m.impl("kv_block_nonfinite", &kv_block_nonfinite_meta); }
