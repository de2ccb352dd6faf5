// The AMX paths of paged_decode_attention (cpu_attention_amx.cpp, called from cpu_attention.cpp)
// and of paged_prefill_attention (cpu_prefill_attention_amx.cpp, from cpu_prefill_attention.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvsentry_amx {

// Whether the AMX path takes these tensors: a bf16 cache, head_dim a multiple of 32 up to 128,
// v_dim a multiple of 32, at most 16 query heads per KV head, blocks of a multiple of 16
// tokens, and a CPU (and build) with AMX-BF16.
bool decode_attention_amx_fits(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache);

// paged_decode_attention's contract, arguments checked by the caller.
void decode_attention_amx(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const int32_t* read_blocks, int64_t num_read, float scale);

// Whether the AMX paths may run: cpu_attention_amx(enable) turns both off (tests check the vector
// kernels on an AMX CPU) and on; the CPU and shapes still decide.
bool attention_amx_enabled();

// Whether bf16 attention may multiply with AVX512-BF16 dot products (the CPU has them and the
// test build's cpu_bf16_dot did not turn them off): decode's scores, prefill's vector tiles.
bool bf16_dot_enabled();

// Whether the AMX prefill path takes these tensors: bf16, head_dim a multiple of 32 up to 128,
// v_dim a multiple of 32, blocks of a multiple of 16 tokens, a CPU (and build) with AMX-BF16.
bool prefill_attention_amx_fits(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache);

// paged_prefill_attention's contract, arguments checked by the caller.
void prefill_attention_amx(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const std::vector<int64_t>& lens, const std::vector<int64_t>& starts, float scale);

}  // namespace kvsentry_amx
