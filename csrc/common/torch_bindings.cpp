// Torch ops for the KV-cache writers, namespace `kvsentry`:
//
//   torch.ops.kvsentry.reshape_and_cache_flash(key, value, k_cache, v_cache,
//       slot_mapping, null_block_writes=None, scale=None) -> ()
//   torch.ops.kvsentry.concat_and_cache_mla(kv_c, k_pe, kv_cache,
//       slot_mapping, null_block_writes=None, scale=None) -> ()
//
// Both only mutate their cache(s) and the optional counter, which the
// schemas declare (Tensor(a!)), so functionalization under torch.compile
// handles them. Implementations:
//   CUDA: the kernels of cache_kernels.cu, on the current stream (CUDA-graph
//         capture safe; nothing here syncs).
//   CPU:  the same per-token code run on the host (cache_kernels_host.cpp),
//         which the engine runs for CPU caches (engine/ops/kv_writer.py).
//   Meta: the checks alone, the fake implementation torch.compile traces
//         through. Sizes are read as SymInts so symbolic shapes trace.
//
// Only core torch headers: no c10/cuda (a CPU torch wheel lacks its
// generated config header), no CUDA runtime. The current CUDA stream comes
// through c10's device-guard interface as an opaque handle.
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cache_kernels.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

int64_t dtype_code(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return KVS_FLOAT32;
    case at::kHalf: return KVS_FLOAT16;
    case at::kBFloat16: return KVS_BFLOAT16;
    case at::kFloat8_e4m3fn: return KVS_FLOAT8_E4M3FN;
    default: return -1;
  }
}

bool is_input_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Checks shared by the CUDA, CPU and Meta implementations. `op` prefixes
// every message. Shape comparisons use SymInts (guards under tracing).
void check_last_dim_contiguous(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(t.sym_stride(-1) == 1, op, ": ", name,
              " must have a contiguous last dimension (stride 1), got strides ", t.sym_strides());
}

void check_same_device(const char* op, const char* name, const Tensor& t, const Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; all tensors must be on one device");
}

void check_slots_counter_scale(const char* op, const Tensor& slot_mapping, const OptTensor& null_block_writes,
                               const OptTensor& scale, const Tensor& cache, const char* cache_name) {
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong, op,
              ": slot_mapping must be a 1-d int64 tensor [num_tokens], got ", slot_mapping.scalar_type(),
              " of shape ", slot_mapping.sym_sizes());
  TORCH_CHECK(slot_mapping.sym_stride(0) == 1 || slot_mapping.sym_size(0) <= 1, op,
              ": slot_mapping must be contiguous, got stride ", slot_mapping.sym_stride(0));
  check_same_device(op, "slot_mapping", slot_mapping, cache, cache_name);
  if (null_block_writes.has_value()) {
    const Tensor& counter = *null_block_writes;
    TORCH_CHECK(counter.scalar_type() == at::kLong && counter.sym_numel() == 1, op,
                ": null_block_writes must be an int64 tensor with one element, got ", counter.scalar_type(),
                " of shape ", counter.sym_sizes());
    check_same_device(op, "null_block_writes", counter, cache, cache_name);
  }
  if (scale.has_value()) {
    TORCH_CHECK(cache.scalar_type() == at::kFloat8_e4m3fn, op, ": scale applies to a float8_e4m3fn ",
                cache_name, " only, got a ", cache.scalar_type(), " ", cache_name);
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->sym_numel() == 1, op,
                ": scale must be a float32 tensor with one element, got ", scale->scalar_type(), " of shape ",
                scale->sym_sizes());
    check_same_device(op, "scale", *scale, cache, cache_name);
  }
}

void check_input_vs_cache(const char* op, const char* in_name, const Tensor& in, const char* cache_name,
                          const Tensor& cache) {
  TORCH_CHECK(is_input_dtype(in.scalar_type()), op, ": ", in_name, " must be float32, float16 or bfloat16, got ",
              in.scalar_type());
  TORCH_CHECK(cache.scalar_type() == in.scalar_type() || cache.scalar_type() == at::kFloat8_e4m3fn, op, ": ",
              cache_name, " dtype ", cache.scalar_type(), " must equal ", in_name, " dtype ", in.scalar_type(),
              " or be float8_e4m3fn");
  check_same_device(op, in_name, in, cache, cache_name);
}

void check_kv(const Tensor& key, const Tensor& value, const Tensor& k_cache, const Tensor& v_cache,
              const Tensor& slot_mapping, const OptTensor& null_block_writes, const OptTensor& scale) {
  constexpr const char* op = "kvsentry::reshape_and_cache_flash";
  TORCH_CHECK(key.dim() == 3, op, ": key must be [num_tokens, num_kv_heads, head_size], got shape ",
              key.sym_sizes());
  TORCH_CHECK(value.sym_sizes() == key.sym_sizes(), op, ": value shape ", value.sym_sizes(),
              " must equal key shape ", key.sym_sizes());
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), op, ": value dtype ", value.scalar_type(),
              " must equal key dtype ", key.scalar_type());
  TORCH_CHECK(k_cache.dim() == 4, op, ": k_cache must be [num_blocks, block_size, num_kv_heads, head_size], got shape ",
              k_cache.sym_sizes());
  TORCH_CHECK(v_cache.sym_sizes() == k_cache.sym_sizes() && v_cache.scalar_type() == k_cache.scalar_type(), op,
              ": v_cache (", v_cache.scalar_type(), " ", v_cache.sym_sizes(), ") must match k_cache (",
              k_cache.scalar_type(), " ", k_cache.sym_sizes(), ")");
  TORCH_CHECK(k_cache.sym_size(2) == key.sym_size(1) && k_cache.sym_size(3) == key.sym_size(2), op,
              ": cache [num_blocks, block_size, num_kv_heads, head_size] = ", k_cache.sym_sizes(),
              " does not fit key [num_tokens, num_kv_heads, head_size] = ", key.sym_sizes());
  check_input_vs_cache(op, "key", key, "k_cache", k_cache);
  check_same_device(op, "value", value, k_cache, "k_cache");
  check_same_device(op, "v_cache", v_cache, k_cache, "k_cache");
  check_last_dim_contiguous(op, "key", key);
  check_last_dim_contiguous(op, "value", value);
  check_last_dim_contiguous(op, "k_cache", k_cache);
  check_last_dim_contiguous(op, "v_cache", v_cache);
  check_slots_counter_scale(op, slot_mapping, null_block_writes, scale, k_cache, "k_cache");
  TORCH_CHECK(key.sym_size(0) >= slot_mapping.sym_size(0), op, ": slot_mapping has ", slot_mapping.sym_size(0),
              " tokens but key only ", key.sym_size(0));
}

void check_mla(const Tensor& kv_c, const Tensor& k_pe, const Tensor& kv_cache, const Tensor& slot_mapping,
               const OptTensor& null_block_writes, const OptTensor& scale) {
  constexpr const char* op = "kvsentry::concat_and_cache_mla";
  TORCH_CHECK(kv_c.dim() == 2, op, ": kv_c must be [num_tokens, kv_lora_rank], got shape ", kv_c.sym_sizes());
  TORCH_CHECK(k_pe.dim() == 2, op, ": k_pe must be [num_tokens, rope_dim], got shape ", k_pe.sym_sizes());
  TORCH_CHECK(k_pe.scalar_type() == kv_c.scalar_type(), op, ": k_pe dtype ", k_pe.scalar_type(),
              " must equal kv_c dtype ", kv_c.scalar_type());
  TORCH_CHECK(kv_cache.dim() == 3, op, ": kv_cache must be [num_blocks, block_size, kv_lora_rank + rope_dim], got shape ",
              kv_cache.sym_sizes());
  TORCH_CHECK(kv_cache.sym_size(2) == kv_c.sym_size(1) + k_pe.sym_size(1), op, ": kv_cache width ",
              kv_cache.sym_size(2), " must be kv_lora_rank + rope_dim = ", kv_c.sym_size(1), " + ", k_pe.sym_size(1));
  check_input_vs_cache(op, "kv_c", kv_c, "kv_cache", kv_cache);
  check_same_device(op, "k_pe", k_pe, kv_cache, "kv_cache");
  check_last_dim_contiguous(op, "kv_c", kv_c);
  check_last_dim_contiguous(op, "k_pe", k_pe);
  check_last_dim_contiguous(op, "kv_cache", kv_cache);
  check_slots_counter_scale(op, slot_mapping, null_block_writes, scale, kv_cache, "kv_cache");
  TORCH_CHECK(kv_c.sym_size(0) >= slot_mapping.sym_size(0) && k_pe.sym_size(0) >= slot_mapping.sym_size(0), op,
              ": slot_mapping has ", slot_mapping.sym_size(0), " tokens but kv_c has ", kv_c.sym_size(0),
              " and k_pe ", k_pe.sym_size(0));
}

int64_t* counter_ptr(const OptTensor& t) { return t.has_value() ? t->data_ptr<int64_t>() : nullptr; }
const float* scale_ptr(const OptTensor& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

KvsKvWriteParams kv_params(const Tensor& key, const Tensor& value, const Tensor& k_cache, const Tensor& v_cache,
                           const Tensor& slot_mapping, const OptTensor& null_block_writes, const OptTensor& scale) {
  KvsKvWriteParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.null_block_writes = counter_ptr(null_block_writes);
  p.scale = scale_ptr(scale);
  p.num_tokens = slot_mapping.size(0);
  p.num_heads = key.size(1);
  p.head_size = key.size(2);
  p.block_size = k_cache.size(1);
  p.num_blocks = k_cache.size(0);
  p.key_token_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.value_token_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  p.k_block_stride = k_cache.stride(0);
  p.k_page_stride = k_cache.stride(1);
  p.k_head_stride = k_cache.stride(2);
  p.v_block_stride = v_cache.stride(0);
  p.v_page_stride = v_cache.stride(1);
  p.v_head_stride = v_cache.stride(2);
  p.in_dtype = dtype_code(key.scalar_type());
  p.cache_dtype = dtype_code(k_cache.scalar_type());
  return p;
}

KvsMlaWriteParams mla_params(const Tensor& kv_c, const Tensor& k_pe, const Tensor& kv_cache, const Tensor& slot_mapping,
                             const OptTensor& null_block_writes, const OptTensor& scale) {
  KvsMlaWriteParams p{};
  p.kv_c = kv_c.data_ptr();
  p.k_pe = k_pe.data_ptr();
  p.kv_cache = kv_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.null_block_writes = counter_ptr(null_block_writes);
  p.scale = scale_ptr(scale);
  p.num_tokens = slot_mapping.size(0);
  p.kv_lora_rank = kv_c.size(1);
  p.rope_dim = k_pe.size(1);
  p.block_size = kv_cache.size(1);
  p.num_blocks = kv_cache.size(0);
  p.kv_c_token_stride = kv_c.stride(0);
  p.k_pe_token_stride = k_pe.stride(0);
  p.cache_block_stride = kv_cache.stride(0);
  p.cache_page_stride = kv_cache.stride(1);
  p.in_dtype = dtype_code(kv_c.scalar_type());
  p.cache_dtype = dtype_code(kv_cache.scalar_type());
  return p;
}

void check_status(const char* op, int status) {
  TORCH_CHECK(status == KVS_OK, op, " failed: ", kvsentry_status_string(status), " (status ", status, ")");
}

// The current CUDA stream of `device` as a cudaStream_t, without CUDA headers.
void* current_cuda_stream(const c10::Device& device) {
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(device).native_handle();
}

// --- reshape_and_cache_flash -------------------------------------------------

void reshape_and_cache_flash_meta(const Tensor& key, const Tensor& value, Tensor& k_cache, Tensor& v_cache,
                                  const Tensor& slot_mapping, const OptTensor& null_block_writes,
                                  const OptTensor& scale) {
  check_kv(key, value, k_cache, v_cache, slot_mapping, null_block_writes, scale);
}

void reshape_and_cache_flash_cpu(const Tensor& key, const Tensor& value, Tensor& k_cache, Tensor& v_cache,
                                 const Tensor& slot_mapping, const OptTensor& null_block_writes,
                                 const OptTensor& scale) {
  check_kv(key, value, k_cache, v_cache, slot_mapping, null_block_writes, scale);
  const KvsKvWriteParams p = kv_params(key, value, k_cache, v_cache, slot_mapping, null_block_writes, scale);
  check_status("kvsentry::reshape_and_cache_flash (cpu)", kvsentry_reshape_and_cache_flash_host(&p));
}

void reshape_and_cache_flash_cuda(const Tensor& key, const Tensor& value, Tensor& k_cache, Tensor& v_cache,
                                  const Tensor& slot_mapping, const OptTensor& null_block_writes,
                                  const OptTensor& scale) {
  check_kv(key, value, k_cache, v_cache, slot_mapping, null_block_writes, scale);
  const c10::DeviceGuard guard(k_cache.device());
  const KvsKvWriteParams p = kv_params(key, value, k_cache, v_cache, slot_mapping, null_block_writes, scale);
  check_status("kvsentry::reshape_and_cache_flash (cuda)",
               kvsentry_reshape_and_cache_flash_cuda(&p, current_cuda_stream(k_cache.device())));
}

// --- concat_and_cache_mla ----------------------------------------------------

void concat_and_cache_mla_meta(const Tensor& kv_c, const Tensor& k_pe, Tensor& kv_cache, const Tensor& slot_mapping,
                               const OptTensor& null_block_writes, const OptTensor& scale) {
  check_mla(kv_c, k_pe, kv_cache, slot_mapping, null_block_writes, scale);
}

void concat_and_cache_mla_cpu(const Tensor& kv_c, const Tensor& k_pe, Tensor& kv_cache, const Tensor& slot_mapping,
                              const OptTensor& null_block_writes, const OptTensor& scale) {
  check_mla(kv_c, k_pe, kv_cache, slot_mapping, null_block_writes, scale);
  const KvsMlaWriteParams p = mla_params(kv_c, k_pe, kv_cache, slot_mapping, null_block_writes, scale);
  check_status("kvsentry::concat_and_cache_mla (cpu)", kvsentry_concat_and_cache_mla_host(&p));
}

void concat_and_cache_mla_cuda(const Tensor& kv_c, const Tensor& k_pe, Tensor& kv_cache, const Tensor& slot_mapping,
                               const OptTensor& null_block_writes, const OptTensor& scale) {
  check_mla(kv_c, k_pe, kv_cache, slot_mapping, null_block_writes, scale);
  const c10::DeviceGuard guard(kv_cache.device());
  const KvsMlaWriteParams p = mla_params(kv_c, k_pe, kv_cache, slot_mapping, null_block_writes, scale);
  check_status("kvsentry::concat_and_cache_mla (cuda)",
               kvsentry_concat_and_cache_mla_cuda(&p, current_cuda_stream(kv_cache.device())));
}

#ifdef KVSENTRY_DEBUG_OPS
// {supported, fp8, width, threads_per_token} of the plan a write would use.
std::vector<int64_t> plan_reshape_and_cache_flash(const Tensor& key, const Tensor& value, const Tensor& k_cache,
                                                  const Tensor& v_cache, const Tensor& slot_mapping,
                                                  const OptTensor& scale) {
  check_kv(key, value, k_cache, v_cache, slot_mapping, std::nullopt, scale);
  const KvsKvWriteParams p = kv_params(key, value, k_cache, v_cache, slot_mapping, std::nullopt, scale);
  std::vector<int64_t> out(4);
  kvsentry_plan_reshape_and_cache_flash(&p, out.data());
  return out;
}

std::vector<int64_t> plan_concat_and_cache_mla(const Tensor& kv_c, const Tensor& k_pe, const Tensor& kv_cache,
                                               const Tensor& slot_mapping, const OptTensor& scale) {
  check_mla(kv_c, k_pe, kv_cache, slot_mapping, std::nullopt, scale);
  const KvsMlaWriteParams p = mla_params(kv_c, k_pe, kv_cache, slot_mapping, std::nullopt, scale);
  std::vector<int64_t> out(4);
  kvsentry_plan_concat_and_cache_mla(&p, out.data());
  return out;
}
#endif

bool built_with_cuda() {
#ifdef KVSENTRY_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int64_t abi_version() { return KVS_ABI_VERSION; }

}  // namespace

TORCH_LIBRARY(kvsentry, m) {
  m.def(
      "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor(c!)? null_block_writes=None, Tensor? scale=None) -> ()");
  m.def(
      "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor(b!)? null_block_writes=None, Tensor? scale=None) -> ()");
  // Build facts, for engine/ops/library.py and the tests (no tensors, no dispatch key).
  m.def("built_with_cuda() -> bool", &built_with_cuda);
  m.def("abi_version() -> int", &abi_version);
}

#ifdef KVSENTRY_DEBUG_OPS
// The test build's own namespace: introspection and switches that tests use to reach each
// kernel path on one CPU. The production library registers none of it (common/debug_switch.h).
TORCH_LIBRARY(kvsentry_debug, m) {
  m.def("plan_reshape_and_cache_flash(Tensor key, Tensor value, Tensor k_cache, Tensor v_cache, "
        "Tensor slot_mapping, Tensor? scale=None) -> int[]",
        &plan_reshape_and_cache_flash);
  m.def("plan_concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor kv_cache, Tensor slot_mapping, "
        "Tensor? scale=None) -> int[]",
        &plan_concat_and_cache_mla);
}
#endif

TORCH_LIBRARY_IMPL(kvsentry, CUDA, m) {
  m.impl("reshape_and_cache_flash", &reshape_and_cache_flash_cuda);
  m.impl("concat_and_cache_mla", &concat_and_cache_mla_cuda);
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) {
  m.impl("reshape_and_cache_flash", &reshape_and_cache_flash_cpu);
  m.impl("concat_and_cache_mla", &concat_and_cache_mla_cpu);
}

TORCH_LIBRARY_IMPL(kvsentry, Meta, m) {
  m.impl("reshape_and_cache_flash", &reshape_and_cache_flash_meta);
  m.impl("concat_and_cache_mla", &concat_and_cache_mla_meta);
}
