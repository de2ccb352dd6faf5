// Sealed-block checksums of the paged KV cache, on CPU:
//
//   out = torch.ops.kvsentry.kv_block_checksums(words, block_ids, multipliers)
//
//   words        int32 [num_blocks, num_layers, chunks, chunk_words]: the cache's bytes as
//                32-bit words, any strides except a contiguous last dim (the storage seen
//                block-first; for the head-major CPU layout a chunk is one head's
//                block_size x head_dim, for MLA one block's latents)
//   block_ids    int64 [n]: the blocks to hash
//   multipliers  int32 [2, chunks, chunk_words], contiguous: odd random constants
//   out          int64 [n, num_layers, 2]: per block and layer, two 32-bit lanes
//                out[i, l, k] = sum_{c, j} words[b_i, l, c, j] * multipliers[k, c, j]  (mod 2^32)
//
// A multilinear hash with odd multipliers: flipping any one bit of a word changes the
// product by an odd multiple of a power of two below 2^32, so every single-bit error
// changes both lanes; other corruption collides with probability ~2^-64 over the random
// multipliers. One pass over the block's memory, no temporaries; at::parallel_for splits
// the (block, layer) pairs. The torch reference (engine/ops/checksum.py) defines the
// result and tests/csrc/test_checksum.py holds the two equal.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

namespace {

using at::Tensor;
constexpr const char* kOp = "kvsentry::kv_block_checksums";

void check(const Tensor& words, const Tensor& block_ids, const Tensor& multipliers) {
  TORCH_CHECK(words.scalar_type() == at::kInt && words.dim() == 4, kOp,
              ": words must be int32 [num_blocks, num_layers, chunks, chunk_words], got ",
              words.scalar_type(), " ", words.sizes());
  TORCH_CHECK(words.size(3) == 0 || words.stride(3) == 1, kOp, ": words' last dim must be contiguous");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1, kOp, ": block_ids must be int64 [n]");
  TORCH_CHECK(multipliers.scalar_type() == at::kInt && multipliers.dim() == 3 && multipliers.size(0) == 2 &&
                  multipliers.size(1) == words.size(2) && multipliers.size(2) == words.size(3) &&
                  multipliers.is_contiguous(),
              kOp, ": multipliers must be contiguous int32 [2, chunks, chunk_words] matching words");
}

Tensor kv_block_checksums_cpu(const Tensor& words, const Tensor& block_ids, const Tensor& multipliers) {
  check(words, block_ids, multipliers);
  const int64_t n = block_ids.size(0), num_layers = words.size(1);
  const int64_t chunks = words.size(2), chunk_words = words.size(3);
  Tensor out = at::empty({n, num_layers, 2}, words.options().dtype(at::kLong));
  const Tensor ids = block_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= id[i] && id[i] < words.size(0), kOp, ": block id ", id[i], " out of range");
  }
  // Unsigned arithmetic: wrap-around is defined, and the reference's int32 products wrap alike.
  const auto* base = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>());
  const auto* m0 = reinterpret_cast<const uint32_t*>(multipliers.data_ptr<int32_t>());
  const uint32_t* m1 = m0 + chunks * chunk_words;
  const int64_t s0 = words.stride(0), s1 = words.stride(1), s2 = words.stride(2);
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, n * num_layers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint32_t* layer = base + id[t / num_layers] * s0 + (t % num_layers) * s1;
      uint32_t a = 0, b = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint32_t* w = layer + c * s2;
        const uint32_t* x0 = m0 + c * chunk_words;
        const uint32_t* x1 = m1 + c * chunk_words;
        for (int64_t j = 0; j < chunk_words; ++j) {  // vectorised: integer sums reassociate exactly
          a += w[j] * x0[j];
          b += w[j] * x1[j];
        }
      }
      o[2 * t] = a;
      o[2 * t + 1] = b;
    }
  });
  return out;
}

Tensor kv_block_checksums_meta(const Tensor& words, const Tensor& block_ids, const Tensor& multipliers) {
  check(words, block_ids, multipliers);
  return at::empty({block_ids.size(0), words.size(1), 2}, words.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("kv_block_checksums(Tensor words, Tensor block_ids, Tensor multipliers) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) { m.impl("kv_block_checksums", &kv_block_checksums_cpu); }

TORCH_LIBRARY_IMPL(kvsentry, Meta, m) { m.impl("kv_block_checksums", &kv_block_checksums_meta); }
