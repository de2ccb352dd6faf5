// CUDA KV-cache writers: reshape_and_cache_flash and concat_and_cache_mla.
//
// One CUDA block per token. The token's slot decides everything up front:
// slot < 0 (PAD_SLOT_ID) returns before any memory is touched, so padded and
// dummy tokens never write, and a slot in block 0 (the null block, which
// must stay zero) bumps a device-side int64 counter that the metrics read
// later without a sync per step. The copy itself is in cache_kernels.cuh,
// shared with the host run that the CPU tests check against the torch
// reference.
//
// Deliberately free of torch headers: a CPU-only torch wheel lacks the
// generated c10/cuda headers, and CI compiles this file with nvcc on such a
// machine so the device code cannot rot. torch_bindings.cpp hands over raw
// pointers, strides and the current stream through cache_kernels.h.
#include <cuda_runtime.h>

#include "../common/cache_kernels.cuh"

namespace kvsentry {

template <typename Body, typename Params>
__global__ void __launch_bounds__(kMaxThreads) cache_write_kernel(const Params p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (!writes_slot(slot, p.num_blocks * p.block_size)) return;  // padded / dummy token
  if (threadIdx.x == 0 && p.null_block_writes != nullptr && in_null_block(slot, p.block_size)) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p.null_block_writes), 1ull);
  }
  Body::run(p, token, slot, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

template <template <int> class Copy, template <typename, int> class Fp8, typename Params>
int launch(const Params& p, const Plan& plan, void* stream) {
  if (p.num_tokens == 0) return KVS_OK;  // a zero-sized grid is a launch error
  const int status = dispatch<Copy, Fp8>(plan, p.in_dtype, [&](auto body) {
    using Body = decltype(body);
    cache_write_kernel<Body, Params><<<static_cast<unsigned int>(p.num_tokens), plan.threads, 0,
                                       static_cast<cudaStream_t>(stream)>>>(p);
  });
  if (status != KVS_OK) return status;
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvsentry

extern "C" int kvsentry_reshape_and_cache_flash_cuda(const KvsKvWriteParams* params, void* stream) {
  return kvsentry::launch<kvsentry::KvCopy, kvsentry::KvFp8>(*params, kvsentry::plan_kv(*params), stream);
}

extern "C" int kvsentry_concat_and_cache_mla_cuda(const KvsMlaWriteParams* params, void* stream) {
  return kvsentry::launch<kvsentry::MlaCopy, kvsentry::MlaFp8>(*params, kvsentry::plan_mla(*params), stream);
}

extern "C" const char* kvsentry_status_string(int status) {
  const char* name = kvsentry::kvs_status_name(status);
  return name != nullptr ? name : cudaGetErrorString(static_cast<cudaError_t>(status));
}
