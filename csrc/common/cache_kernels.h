// C ABI between the torch bindings (torch_bindings.cpp, host compiler) and the
// KV-cache writers (cache_kernels.cu for the GPU, cache_kernels_host.cpp for
// the host run of the same per-token code).
//
// Neither torch nor CUDA types cross this boundary, on purpose: a CPU-only
// torch wheel ships without c10/cuda's generated headers, so keeping the .cu
// free of torch lets CI compile the device code with nvcc on a machine
// without a GPU, and keeping the bindings free of CUDA headers lets the same
// bindings build against a CPU torch for tests.
#ifndef KVSENTRY_CACHE_KERNELS_H_
#define KVSENTRY_CACHE_KERNELS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever a struct below changes layout.
#define KVS_ABI_VERSION 1

// Element types of inputs and caches.
enum KvsDtype {
  KVS_FLOAT32 = 0,
  KVS_FLOAT16 = 1,
  KVS_BFLOAT16 = 2,
  KVS_FLOAT8_E4M3FN = 3,  // cache only: inputs are converted, optionally divided by a scale
};

// Error codes returned by the launchers besides cudaError_t values (> 0).
enum KvsStatus {
  KVS_OK = 0,
  KVS_ERR_NO_CUDA = -1,      // the library was built without cache_kernels.cu
  KVS_ERR_BAD_DTYPE = -2,    // an (input, cache) dtype pair the kernels do not handle
};

// reshape_and_cache_flash. Every field is 8 bytes wide so the layout has no
// padding and is identical for every compiler. Strides are in elements of
// the tensor they belong to; every tensor's last dimension has stride 1.
typedef struct KvsKvWriteParams {
  const void* key;              // [num_tokens, num_heads, head_size]
  const void* value;            // [num_tokens, num_heads, head_size]
  void* k_cache;                // [num_blocks, block_size, num_heads, head_size]
  void* v_cache;                // [num_blocks, block_size, num_heads, head_size]
  const int64_t* slot_mapping;  // [num_tokens]; slot < 0 (PAD_SLOT_ID) writes nothing
  int64_t* null_block_writes;   // [1] counter of writes into block 0, or NULL
  const float* scale;           // [1] fp8 cache: stored = input / scale; or NULL (no scaling)
  int64_t num_tokens;
  int64_t num_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t num_blocks;
  int64_t key_token_stride, key_head_stride;
  int64_t value_token_stride, value_head_stride;
  int64_t k_block_stride, k_page_stride, k_head_stride;
  int64_t v_block_stride, v_page_stride, v_head_stride;
  int64_t in_dtype;             // KvsDtype of key and value
  int64_t cache_dtype;          // KvsDtype of k_cache and v_cache
} KvsKvWriteParams;

// concat_and_cache_mla: one latent row per token, compressed kv first, then
// the rope part.
typedef struct KvsMlaWriteParams {
  const void* kv_c;             // [num_tokens, kv_lora_rank]
  const void* k_pe;             // [num_tokens, rope_dim]
  void* kv_cache;               // [num_blocks, block_size, kv_lora_rank + rope_dim]
  const int64_t* slot_mapping;  // [num_tokens]
  int64_t* null_block_writes;   // [1] or NULL
  const float* scale;           // [1] or NULL
  int64_t num_tokens;
  int64_t kv_lora_rank;
  int64_t rope_dim;
  int64_t block_size;
  int64_t num_blocks;
  int64_t kv_c_token_stride;
  int64_t k_pe_token_stride;
  int64_t cache_block_stride, cache_page_stride;
  int64_t in_dtype;
  int64_t cache_dtype;
} KvsMlaWriteParams;

// GPU: enqueue the write on `stream` (a cudaStream_t). Returns KVS_OK, a
// KvsStatus, or a cudaError_t from the launch. Pointers are device pointers.
int kvsentry_reshape_and_cache_flash_cuda(const KvsKvWriteParams* params, void* stream);
int kvsentry_concat_and_cache_mla_cuda(const KvsMlaWriteParams* params, void* stream);
const char* kvsentry_status_string(int status);

// Host: run the kernels' per-token code on the CPU, thread by thread, with
// the same plan (vector width, threads per token) the GPU launch would use.
// Pointers are host pointers. Returns KVS_OK or KVS_ERR_BAD_DTYPE.
int kvsentry_reshape_and_cache_flash_host(const KvsKvWriteParams* params);
int kvsentry_concat_and_cache_mla_host(const KvsMlaWriteParams* params);

// The launch plan both of the above would use, for tests and benchmarks:
// out = {supported, fp8, width, threads_per_token}; width is bytes per copy
// unit, or input elements per fp8 group.
void kvsentry_plan_reshape_and_cache_flash(const KvsKvWriteParams* params, int64_t out[4]);
void kvsentry_plan_concat_and_cache_mla(const KvsMlaWriteParams* params, int64_t out[4]);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // KVSENTRY_CACHE_KERNELS_H_
