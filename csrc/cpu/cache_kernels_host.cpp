// Host run of the KV-cache writers: the kernels' per-token code
// (cache_kernels.cuh) executed on the CPU, token by token and thread by
// thread, with the plan the GPU launch would use. It backs the ops' CPU
// implementation, which the CPU tests compare bit for bit with the torch
// reference; the engine runs it for CPU caches (engine/ops/kv_writer.py).
//
// Built without KVSENTRY_WITH_CUDA (a CPU-only build), this file also
// provides the GPU entry points as stubs that report KVS_ERR_NO_CUDA.
#include "../common/cache_kernels.cuh"

namespace kvsentry {
namespace {

template <typename Body, typename Params>
void run_on_host(const Params& p, int threads) {
  const int64_t num_slots = p.num_blocks * p.block_size;
  for (int64_t token = 0; token < p.num_tokens; ++token) {
    const int64_t slot = p.slot_mapping[token];
    if (!writes_slot(slot, num_slots)) continue;  // padded / dummy token
    if (p.null_block_writes != nullptr && in_null_block(slot, p.block_size)) ++*p.null_block_writes;
    for (int tid = 0; tid < threads; ++tid) Body::run(p, token, slot, tid, threads);
  }
}

}  // namespace
}  // namespace kvsentry

extern "C" int kvsentry_reshape_and_cache_flash_host(const KvsKvWriteParams* params) {
  const kvsentry::Plan plan = kvsentry::plan_kv(*params);
  return kvsentry::dispatch<kvsentry::KvCopy, kvsentry::KvFp8>(plan, params->in_dtype, [&](auto body) {
    kvsentry::run_on_host<decltype(body)>(*params, plan.threads);
  });
}

extern "C" int kvsentry_concat_and_cache_mla_host(const KvsMlaWriteParams* params) {
  const kvsentry::Plan plan = kvsentry::plan_mla(*params);
  return kvsentry::dispatch<kvsentry::MlaCopy, kvsentry::MlaFp8>(plan, params->in_dtype, [&](auto body) {
    kvsentry::run_on_host<decltype(body)>(*params, plan.threads);
  });
}

namespace {
void write_plan(const kvsentry::Plan& plan, int64_t out[4]) {
  out[0] = plan.valid;
  out[1] = plan.fp8;
  out[2] = plan.width;
  out[3] = plan.threads;
}
}  // namespace

extern "C" void kvsentry_plan_reshape_and_cache_flash(const KvsKvWriteParams* params, int64_t out[4]) {
  write_plan(kvsentry::plan_kv(*params), out);
}

extern "C" void kvsentry_plan_concat_and_cache_mla(const KvsMlaWriteParams* params, int64_t out[4]) {
  write_plan(kvsentry::plan_mla(*params), out);
}

#ifndef KVSENTRY_WITH_CUDA
extern "C" int kvsentry_reshape_and_cache_flash_cuda(const KvsKvWriteParams*, void*) { return KVS_ERR_NO_CUDA; }
extern "C" int kvsentry_concat_and_cache_mla_cuda(const KvsMlaWriteParams*, void*) { return KVS_ERR_NO_CUDA; }
extern "C" const char* kvsentry_status_string(int status) {
  const char* name = kvsentry::kvs_status_name(status);
  return name != nullptr ? name : "unknown kvsentry status";
}
#endif
