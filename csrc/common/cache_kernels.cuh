// The per-token code of the KV-cache writers, shared by the CUDA kernels
// (cache_kernels.cu, compiled by nvcc for the device) and by their host run
// (cache_kernels_host.cpp, compiled by the host compiler). One source for
// both means the CPU tests exercise the exact indexing, vectorisation plan
// and fp8 rounding the GPU runs.
//
// Contract (engine/kv_writer.py, write_kv_reference / write_mla_reference):
//   * slot < 0 (PAD_SLOT_ID) writes nothing: padded and dummy tokens never
//     touch the cache. A slot past the cache's end is skipped too, because a
//     device-side bounds error cannot be raised without a sync and a write
//     there would corrupt unrelated memory.
//   * same dtype in and out: a bitwise copy.
//   * float8_e4m3fn cache: value -> float32 -> (/ scale, IEEE division, when
//     a scale is given) -> e4m3fn, rounded to nearest even, saturating to
//     +-448 for finite overflow and inf (as vLLM's __NV_SATFINITE: an
//     overflow must not put a NaN in the cache), NaN stays NaN. The reference
//     clamps before torch's .to(), whose overflow changed between versions.
//   * a write whose slot is in block 0 (the null block) adds 1 to the
//     int64 counter, when one is given.
#ifndef KVSENTRY_CACHE_KERNELS_CUH_
#define KVSENTRY_CACHE_KERNELS_CUH_

#include <stdint.h>
#include <string.h>

#include "cache_kernels.h"

#if defined(__CUDACC__)
#define KVS_HD __host__ __device__ __forceinline__
#else
#define KVS_HD inline
#endif

namespace kvsentry {

constexpr int kMaxThreads = 512;  // threads per token (CUDA block)

// ---------------------------------------------------------------------------
// Element conversions. Integer-only except the scale division, so host and
// device agree bit for bit whatever the floating-point flags.

KVS_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

KVS_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

// Correctly rounded a / b. Explicit on the device so that a fast-math build
// flag cannot swap in the approximate division and break bitwise equality
// with torch's `x / scale`.
KVS_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// IEEE binary16 -> binary32 bits, exact.
KVS_HD uint32_t half_to_float_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return sign | 0x7F800000u | (mantissa << 13);  // inf, NaN
  if (exponent == 0) {
    if (mantissa == 0) return sign;  // +-0
    // Subnormal half: mantissa * 2^-24. Shift until the implicit bit (bit
    // 10) is set; each shift lowers the binary32 exponent by one.
    exponent = 113;  // binary32 exponent field of 2^-14
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    return sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  return sign | ((exponent + 112u) << 23) | (mantissa << 13);  // rebias 15 -> 127
}

// binary32 bits -> float8_e4m3fn (bias 7, no inf, 0x7F = NaN): torch's
// nearest-even rounding below 448, saturation above.
KVS_HD uint8_t float_bits_to_e4m3fn(uint32_t bits) {
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return sign | 0x7Fu;   // NaN stays NaN
  if (mag >= 0x43E00000u) return sign | 0x7Eu;  // >= 448 and inf saturate to 448
  if (mag < 0x3C800000u) {
    // Below 2^-6, the smallest normal: a subnormal in units of 2^-9.
    // units = full_mantissa * 2^(exponent - 141), rounded to nearest even.
    const uint32_t exponent = mag >> 23;
    if (exponent < 117) return sign;  // < 0.5 units (binary32 subnormals included)
    const uint32_t full = (mag & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 141u - exponent;  // 21..24
    uint32_t units = full >> shift;
    const uint32_t rest = full & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (units & 1u))) ++units;
    return sign | static_cast<uint8_t>(units);  // 8 units is 2^-6, encoded 0x08
  }
  // Normal: rebias the exponent (127 -> 7) and round the mantissa from 23 to
  // 3 bits, nearest even. Inputs below 448 cannot carry into 0x7F (NaN).
  uint32_t r = mag - (120u << 23);
  r += 0x7FFFFu + ((r >> 20) & 1u);
  return sign | static_cast<uint8_t>(r >> 20);
}

// Input element types, as raw bits plus the exact widening to binary32.
struct F32In {
  using Bits = uint32_t;
  static KVS_HD uint32_t to_float_bits(uint32_t b) { return b; }
};
struct F16In {
  using Bits = uint16_t;
  static KVS_HD uint32_t to_float_bits(uint16_t b) { return half_to_float_bits(b); }
};
struct BF16In {
  using Bits = uint16_t;
  static KVS_HD uint32_t to_float_bits(uint16_t b) { return static_cast<uint32_t>(b) << 16; }
};

template <typename In>
KVS_HD uint8_t to_e4m3fn(typename In::Bits b, bool has_scale, float scale) {
  uint32_t f = In::to_float_bits(b);
  if (has_scale) f = float_to_bits(div_rn(bits_to_float(f), scale));
  return float_bits_to_e4m3fn(f);
}

// ---------------------------------------------------------------------------
// Memory units. On the device the CUDA vector types, which nvcc turns into
// single 8/16-byte loads and stores (ld.global.v4.u32 and friends).

#if defined(__CUDACC__)
using U128 = uint4;
using U64 = uint2;
#else
struct alignas(16) U128 { uint32_t x, y, z, w; };
struct alignas(8) U64 { uint32_t x, y; };
#endif

template <int kBytes> struct UnitOf;
template <> struct UnitOf<16> { using type = U128; };
template <> struct UnitOf<8> { using type = U64; };
template <> struct UnitOf<4> { using type = uint32_t; };
template <> struct UnitOf<2> { using type = uint16_t; };
template <> struct UnitOf<1> { using type = uint8_t; };

KVS_HD bool writes_slot(int64_t slot, int64_t num_slots) { return slot >= 0 && slot < num_slots; }
KVS_HD bool in_null_block(int64_t slot, int64_t block_size) { return slot < block_size; }  // slot >= 0 here

KVS_HD int64_t dtype_size(int64_t dtype) {
  switch (dtype) {
    case KVS_FLOAT32: return 4;
    case KVS_FLOAT16: return 2;
    case KVS_BFLOAT16: return 2;
    case KVS_FLOAT8_E4M3FN: return 1;
    default: return 0;
  }
}

// Loads VEC input elements with one 16-byte load (VEC * sizeof(Bits) == 16)
// or a single element (VEC == 1), converts them and stores VEC bytes at once.
template <typename In, int VEC>
KVS_HD void convert_group(const char* src, char* dst, bool has_scale, float scale) {
  using Bits = typename In::Bits;
  using InUnit = typename UnitOf<VEC * sizeof(Bits)>::type;
  using OutUnit = typename UnitOf<VEC>::type;
  static_assert(VEC == 1 || VEC * sizeof(Bits) == 16, "one 16-byte load per group");
  const InUnit raw = *reinterpret_cast<const InUnit*>(src);
  Bits in[VEC];
  memcpy(in, &raw, sizeof raw);
  uint8_t out[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_e4m3fn<In>(in[j], has_scale, scale);
  OutUnit packed;
  memcpy(&packed, out, sizeof packed);
  *reinterpret_cast<OutUnit*>(dst) = packed;
}

// ---------------------------------------------------------------------------
// Per-token bodies. `run` is called by every thread of the token's CUDA block
// (or, on the host, once per emulated thread); thread `tid` of `nthreads`
// handles units tid, tid + nthreads, ... There is no shared memory and no
// barrier, so the host may run the threads one after another.

// reshape_and_cache_flash, cache dtype == input dtype: a dtype-agnostic
// copy in kBytes-wide units.
template <int kBytes>
struct KvCopy {
  static KVS_HD void run(const KvsKvWriteParams& p, int64_t token, int64_t slot, int tid, int nthreads) {
    using Unit = typename UnitOf<kBytes>::type;
    const int64_t esize = dtype_size(p.in_dtype);
    const int64_t block = slot / p.block_size, page = slot % p.block_size;
    const char* key = static_cast<const char*>(p.key) + token * p.key_token_stride * esize;
    const char* value = static_cast<const char*>(p.value) + token * p.value_token_stride * esize;
    char* k_dst = static_cast<char*>(p.k_cache) + (block * p.k_block_stride + page * p.k_page_stride) * esize;
    char* v_dst = static_cast<char*>(p.v_cache) + (block * p.v_block_stride + page * p.v_page_stride) * esize;
    const int64_t key_head = p.key_head_stride * esize, value_head = p.value_head_stride * esize;
    const int64_t k_head = p.k_head_stride * esize, v_head = p.v_head_stride * esize;
    const int units_per_head = static_cast<int>(p.head_size * esize / kBytes);
    const int num_units = static_cast<int>(p.num_heads) * units_per_head;
    for (int i = tid; i < num_units; i += nthreads) {
      const int head = i / units_per_head, u = i - head * units_per_head;
      // Both loads before either store: the pointers may alias as far as
      // the compiler knows, and this keeps two loads in flight per thread.
      const Unit k = reinterpret_cast<const Unit*>(key + head * key_head)[u];
      const Unit v = reinterpret_cast<const Unit*>(value + head * value_head)[u];
      reinterpret_cast<Unit*>(k_dst + head * k_head)[u] = k;
      reinterpret_cast<Unit*>(v_dst + head * v_head)[u] = v;
    }
  }
};

// reshape_and_cache_flash into a float8_e4m3fn cache, VEC elements a unit.
template <typename In, int VEC>
struct KvFp8 {
  static KVS_HD void run(const KvsKvWriteParams& p, int64_t token, int64_t slot, int tid, int nthreads) {
    constexpr int64_t kInSize = sizeof(typename In::Bits);
    const int64_t block = slot / p.block_size, page = slot % p.block_size;
    const char* key = static_cast<const char*>(p.key) + token * p.key_token_stride * kInSize;
    const char* value = static_cast<const char*>(p.value) + token * p.value_token_stride * kInSize;
    char* k_dst = static_cast<char*>(p.k_cache) + block * p.k_block_stride + page * p.k_page_stride;
    char* v_dst = static_cast<char*>(p.v_cache) + block * p.v_block_stride + page * p.v_page_stride;
    const bool has_scale = p.scale != nullptr;
    const float scale = has_scale ? *p.scale : 1.0f;
    const int groups_per_head = static_cast<int>(p.head_size / VEC);
    const int num_groups = static_cast<int>(p.num_heads) * groups_per_head;
    for (int i = tid; i < num_groups; i += nthreads) {
      const int head = i / groups_per_head, g = i - head * groups_per_head;
      const int64_t elem = static_cast<int64_t>(g) * VEC;
      convert_group<In, VEC>(key + (head * p.key_head_stride + elem) * kInSize,
                             k_dst + head * p.k_head_stride + elem, has_scale, scale);
      convert_group<In, VEC>(value + (head * p.value_head_stride + elem) * kInSize,
                             v_dst + head * p.v_head_stride + elem, has_scale, scale);
    }
  }
};

// concat_and_cache_mla, same dtype: units [0, n_c) come from kv_c, the rest
// from k_pe, written right after the compressed part.
template <int kBytes>
struct MlaCopy {
  static KVS_HD void run(const KvsMlaWriteParams& p, int64_t token, int64_t slot, int tid, int nthreads) {
    using Unit = typename UnitOf<kBytes>::type;
    const int64_t esize = dtype_size(p.in_dtype);
    const int64_t block = slot / p.block_size, page = slot % p.block_size;
    const Unit* kv_c = reinterpret_cast<const Unit*>(static_cast<const char*>(p.kv_c) +
                                                     token * p.kv_c_token_stride * esize);
    const Unit* k_pe = reinterpret_cast<const Unit*>(static_cast<const char*>(p.k_pe) +
                                                     token * p.k_pe_token_stride * esize);
    char* row = static_cast<char*>(p.kv_cache) + (block * p.cache_block_stride + page * p.cache_page_stride) * esize;
    Unit* dst_c = reinterpret_cast<Unit*>(row);
    Unit* dst_pe = reinterpret_cast<Unit*>(row + p.kv_lora_rank * esize);
    const int n_c = static_cast<int>(p.kv_lora_rank * esize / kBytes);
    const int n_all = n_c + static_cast<int>(p.rope_dim * esize / kBytes);
    for (int i = tid; i < n_all; i += nthreads) {
      if (i < n_c) {
        dst_c[i] = kv_c[i];
      } else {
        dst_pe[i - n_c] = k_pe[i - n_c];
      }
    }
  }
};

template <typename In, int VEC>
struct MlaFp8 {
  static KVS_HD void run(const KvsMlaWriteParams& p, int64_t token, int64_t slot, int tid, int nthreads) {
    constexpr int64_t kInSize = sizeof(typename In::Bits);
    const int64_t block = slot / p.block_size, page = slot % p.block_size;
    const char* kv_c = static_cast<const char*>(p.kv_c) + token * p.kv_c_token_stride * kInSize;
    const char* k_pe = static_cast<const char*>(p.k_pe) + token * p.k_pe_token_stride * kInSize;
    char* row = static_cast<char*>(p.kv_cache) + block * p.cache_block_stride + page * p.cache_page_stride;
    const bool has_scale = p.scale != nullptr;
    const float scale = has_scale ? *p.scale : 1.0f;
    const int n_c = static_cast<int>(p.kv_lora_rank / VEC);
    const int n_all = n_c + static_cast<int>(p.rope_dim / VEC);
    for (int i = tid; i < n_all; i += nthreads) {
      if (i < n_c) {
        const int64_t elem = static_cast<int64_t>(i) * VEC;
        convert_group<In, VEC>(kv_c + elem * kInSize, row + elem, has_scale, scale);
      } else {
        const int64_t elem = static_cast<int64_t>(i - n_c) * VEC;
        convert_group<In, VEC>(k_pe + elem * kInSize, row + p.kv_lora_rank + elem, has_scale, scale);
      }
    }
  }
};

// ---------------------------------------------------------------------------
// Launch plan, computed on the host from the parameters: which body, how
// wide a unit, how many threads per token. Shared by the launcher and the
// host run so both take the same path.

struct Plan {
  bool valid;    // the (input, cache) dtype pair is supported
  bool fp8;      // converting into a float8_e4m3fn cache
  int width;     // copy: bytes per unit (16/8/4/2/1); fp8: elements per group (16 / input size, or 1)
  int threads;   // threads per token, a multiple of 32 in [32, kMaxThreads]
};

inline bool divides(int64_t width, int64_t x) { return x % width == 0; }
inline bool aligned_to(const void* ptr, int64_t width) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(width) == 0;
}

inline int threads_for(int64_t units) {
  int64_t threads = (units + 31) / 32 * 32;
  if (threads < 32) threads = 32;
  if (threads > kMaxThreads) threads = kMaxThreads;
  return static_cast<int>(threads);
}

inline bool is_input_dtype(int64_t dtype) {
  return dtype == KVS_FLOAT32 || dtype == KVS_FLOAT16 || dtype == KVS_BFLOAT16;
}

// Widest unit whose size divides every byte offset a thread can form and
// every base pointer: only then is each unit access naturally aligned.
// `offsets` are in bytes.
template <int N>
inline int widest_unit(const int64_t (&offsets)[N], const void* const (&ptrs)[4], int max_width) {
  for (int width = max_width; width > 1; width /= 2) {
    bool ok = true;
    for (int64_t off : offsets) ok = ok && divides(width, off);
    for (const void* ptr : ptrs) ok = ok && aligned_to(ptr, width);
    if (ok) return width;
  }
  return 1;
}

inline Plan plan_kv(const KvsKvWriteParams& p) {
  Plan plan{false, false, 1, 32};
  if (!is_input_dtype(p.in_dtype)) return plan;
  const int64_t in = dtype_size(p.in_dtype);
  // A head stride never matters when there is one head (size-1 dims may
  // carry any stride).
  const int64_t many = p.num_heads > 1 ? 1 : 0;
  if (p.cache_dtype == p.in_dtype) {
    const int64_t offsets[] = {p.head_size * in,
                               p.key_token_stride * in, many * p.key_head_stride * in,
                               p.value_token_stride * in, many * p.value_head_stride * in,
                               p.k_block_stride * in, p.k_page_stride * in, many * p.k_head_stride * in,
                               p.v_block_stride * in, p.v_page_stride * in, many * p.v_head_stride * in};
    const void* const ptrs[] = {p.key, p.value, p.k_cache, p.v_cache};
    plan = Plan{true, false, widest_unit(offsets, ptrs, 16), 32};
    plan.threads = threads_for(p.num_heads * p.head_size * in / plan.width);
  } else if (p.cache_dtype == KVS_FLOAT8_E4M3FN) {
    // A group is one 16-byte input load and a 16/in-byte cache store; in
    // elements, every offset must be a multiple of the group size.
    const int vec = static_cast<int>(16 / in);
    const int64_t offsets[] = {p.head_size,
                               p.key_token_stride, many * p.key_head_stride,
                               p.value_token_stride, many * p.value_head_stride,
                               p.k_block_stride, p.k_page_stride, many * p.k_head_stride,
                               p.v_block_stride, p.v_page_stride, many * p.v_head_stride};
    bool ok = true;
    for (int64_t off : offsets) ok = ok && divides(vec, off);
    ok = ok && aligned_to(p.key, 16) && aligned_to(p.value, 16) &&
         aligned_to(p.k_cache, vec) && aligned_to(p.v_cache, vec);
    plan = Plan{true, true, ok ? vec : 1, 32};
    plan.threads = threads_for(p.num_heads * p.head_size / plan.width);
  }
  return plan;
}

inline Plan plan_mla(const KvsMlaWriteParams& p) {
  Plan plan{false, false, 1, 32};
  if (!is_input_dtype(p.in_dtype)) return plan;
  const int64_t in = dtype_size(p.in_dtype);
  if (p.cache_dtype == p.in_dtype) {
    const int64_t offsets[] = {p.kv_lora_rank * in, p.rope_dim * in, p.kv_c_token_stride * in,
                               p.k_pe_token_stride * in, p.cache_block_stride * in, p.cache_page_stride * in};
    const void* const ptrs[] = {p.kv_c, p.k_pe, p.kv_cache, p.kv_cache};
    plan = Plan{true, false, widest_unit(offsets, ptrs, 16), 32};
    plan.threads = threads_for((p.kv_lora_rank + p.rope_dim) * in / plan.width);
  } else if (p.cache_dtype == KVS_FLOAT8_E4M3FN) {
    const int vec = static_cast<int>(16 / in);
    const int64_t offsets[] = {p.kv_lora_rank, p.rope_dim, p.kv_c_token_stride,
                               p.k_pe_token_stride, p.cache_block_stride, p.cache_page_stride};
    bool ok = true;
    for (int64_t off : offsets) ok = ok && divides(vec, off);
    ok = ok && aligned_to(p.kv_c, 16) && aligned_to(p.k_pe, 16) && aligned_to(p.kv_cache, vec);
    plan = Plan{true, true, ok ? vec : 1, 32};
    plan.threads = threads_for((p.kv_lora_rank + p.rope_dim) / plan.width);
  }
  return plan;
}

// Calls f(Body{}) with the body the plan picked; returns KVS_ERR_BAD_DTYPE
// for a pair no body handles. f is a generic lambda: the launcher
// instantiates a kernel per body, the host run a loop per body.
template <template <int> class Copy, template <typename, int> class Fp8, typename F>
inline int dispatch(const Plan& plan, int64_t in_dtype, F&& f) {
  if (!plan.valid) return KVS_ERR_BAD_DTYPE;
  if (!plan.fp8) {
    switch (plan.width) {
      case 16: f(Copy<16>{}); return KVS_OK;
      case 8: f(Copy<8>{}); return KVS_OK;
      case 4: f(Copy<4>{}); return KVS_OK;
      case 2: f(Copy<2>{}); return KVS_OK;
      default: f(Copy<1>{}); return KVS_OK;
    }
  }
  const bool vec = plan.width > 1;
  switch (in_dtype) {
    case KVS_FLOAT32: vec ? f(Fp8<F32In, 4>{}) : f(Fp8<F32In, 1>{}); return KVS_OK;
    case KVS_FLOAT16: vec ? f(Fp8<F16In, 8>{}) : f(Fp8<F16In, 1>{}); return KVS_OK;
    case KVS_BFLOAT16: vec ? f(Fp8<BF16In, 8>{}) : f(Fp8<BF16In, 1>{}); return KVS_OK;
    default: return KVS_ERR_BAD_DTYPE;
  }
}

inline const char* kvs_status_name(int status) {
  switch (status) {
    case KVS_OK: return "ok";
    case KVS_ERR_NO_CUDA: return "kvsentry was built without its CUDA kernels (csrc/cuda/cache_kernels.cu)";
    case KVS_ERR_BAD_DTYPE: return "unsupported (input, cache) dtype pair";
    default: return nullptr;
  }
}

}  // namespace kvsentry

#endif  // KVSENTRY_CACHE_KERNELS_CUH_
