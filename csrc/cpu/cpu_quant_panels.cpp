// GGUF-quantized panels (cpu_quant_panels.h): packing, and the dequantized weight back.
//
//   packed = torch.ops.kvsentry.quant_panels_pack(raw, type, k)
//            raw [N, K / 32 * type size] uint8: a GGUF tensor's rows of Q4_1 (type 3, 20-byte
//            blocks) or Q8_0 (type 8, 34-byte blocks) -> [ceil(N / 64), K / 32, block bytes]
//            uint8, which bf16_gemm and f32_gemm take in place of their own packed weight
//   w = torch.ops.kvsentry.quant_panels_unpack(packed, N, dtype)  -> [N, K] bf16 or float32,
//            through the GEMMs' own dequantizing code: what they multiply by
//   torch.ops.kvsentry.quant_panels_supported(dtype) -> bool  the GEMM of that dtype takes them
//   packed = torch.ops.kvsentry.quant_rows_pack(raw, type, k)
//            Q4_1 rows -> [ceil(N / 64), K / 32, 80, 16] uint8: the rows layout (cpu_quant_panels.h),
//            which bf16_gemm's AMX kernel takes in place of the panels (quant_panels_unpack too)
//   torch.ops.kvsentry.quant_rows_supported() -> bool  this CPU runs that kernel on them
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_quant_panels.h"

namespace {

using at::Tensor;
using namespace kvsentry_quant;
constexpr const char* kOp = "kvsentry::quant_panels";

int64_t gguf_block_bytes(int64_t type) { return type == kQ4_1 ? 20 : type == kQ8_0 ? 34 : 0; }

// One GGUF block (a row's 32 K) into output `o` of a panel block `dst`.
void place(const uint8_t* src, int64_t type, int64_t o, uint8_t* dst) {
  const int64_t g = o / 16, i = o % 16, half = i / 8, lane0 = 2 * (i % 8);
  std::memcpy(dst + 2 * o, src, 2);  // the scale
  if (type == kQ4_1) {
    std::memcpy(dst + kScales + 2 * o, src + 2, 2);  // the minimum
    uint8_t* q = dst + 2 * kScales;
    for (int64_t k = 0; k < kBlockK; ++k) {
      const uint8_t v = k < 16 ? src[4 + k] & 0x0F : src[4 + k - 16] >> 4;
      uint8_t& byte = q[(k / 2 * 4 + g) * 16 + lane0 + k % 2];
      byte = static_cast<uint8_t>(byte | (half ? v << 4 : v));
    }
  } else {
    uint8_t* q = dst + kScales;
    for (int64_t k = 0; k < kBlockK; ++k) q[(k / 2 * 4 + g) * 32 + 16 * half + lane0 + k % 2] = src[2 + k];
  }
}

// raw's GGUF rows (blocks of `type`, K = k) into a zeroed tensor of `shape(panels, blocks)`
// whose blocks lie `bytes` apart, panel by panel: place(row's block, output o, block's dst) for
// each output of each panel (padding outputs stay zero: scale 0, quants 0, never stored).
template <typename Shape, typename Place>
Tensor pack_blocks(const Tensor& raw_in, int64_t type, int64_t k, const char* op, int64_t bytes, const Shape& shape,
                   const Place& place) {
  TORCH_CHECK(k > 0 && k % kBlockK == 0, kOp, op, ": K = ", k, " is not whole blocks of 32");
  const int64_t blocks = k / kBlockK, gguf_bytes = gguf_block_bytes(type);
  TORCH_CHECK(raw_in.dim() == 2 && raw_in.scalar_type() == at::kByte && raw_in.device().is_cpu() &&
                  raw_in.size(1) == blocks * gguf_bytes,
              kOp, op, ": raw must be CPU uint8 [N, ", blocks * gguf_bytes, "], got ", raw_in.sizes());
  const Tensor raw = raw_in.contiguous();
  const int64_t n = raw.size(0), panels = (n + kOutputs - 1) / kOutputs;
  Tensor packed = at::zeros(shape(panels, blocks), raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t o = 0; o < kOutputs && panel * kOutputs + o < n; ++o) {
        const uint8_t* row = src + (panel * kOutputs + o) * blocks * gguf_bytes;
        for (int64_t b = 0; b < blocks; ++b) place(row + b * gguf_bytes, o, dst + (panel * blocks + b) * bytes);
      }
    }
  });
  return packed;
}

Tensor pack(const Tensor& raw, int64_t type, int64_t k) {
  TORCH_CHECK(gguf_block_bytes(type) > 0, kOp, "_pack: GGML type ", type, " has no panels (Q4_1 = 3 and Q8_0 = 8 do)");
  const int64_t bytes = block_bytes(type);
  return pack_blocks(
      raw, type, k, "_pack", bytes,
      [bytes](int64_t panels, int64_t blocks) { return std::vector<int64_t>{panels, blocks, bytes}; },
      [type](const uint8_t* src, int64_t o, uint8_t* dst) { place(src, type, o, dst); });
}

// One Q4_1 GGUF block (a row's 32 K) into output `o` of a rows-layout block `dst`.
void place_row(const uint8_t* src, int64_t o, uint8_t* dst) {
  std::memcpy(dst + 2 * o, src, 2);                // the scale
  std::memcpy(dst + kScales + 2 * o, src + 2, 2);  // the minimum
  uint8_t* q = dst + 2 * kScales + kRowsQuantBytes * o;
  for (int64_t k = 0; k < kBlockK; ++k) {
    const uint8_t v = k < 16 ? src[4 + k] & 0x0F : src[4 + k - 16] >> 4;
    int64_t byte;
    int shift;
    rows_nibble(k, byte, shift);
    q[byte] = static_cast<uint8_t>(q[byte] | v << shift);
  }
}

// The rows layout's kernel runs here: bf16_gemm's AMX tiles, and the lookups.
bool rows_op_supported() {
#if defined(__AVX512F__)
  return kvsentry_amx::supported() && rows_supported();
#else
  return false;
#endif
}

Tensor pack_rows(const Tensor& raw, int64_t type, int64_t k) {
  TORCH_CHECK(type == kQ4_1, kOp, "_rows_pack: GGML type ", type, " has no rows layout (Q4_1 = 3 has)");
  return pack_blocks(
      raw, type, k, "_rows_pack", kRowsBlockBytes,
      [](int64_t panels, int64_t blocks) {
        return std::vector<int64_t>{panels, blocks, kRowsBlockBytes / kRowsQuantBytes, kRowsQuantBytes};
      },
      place_row);
}

bool supported(at::ScalarType dtype) {
#if defined(__AVX512F__)
  // bf16 without AVX512-BF16: bf16_gemm's "avx512f" kernel, through the float32 GEMM.
  if (dtype == at::kFloat || dtype == at::kBFloat16) return __builtin_cpu_supports("avx512f");
#endif
  (void)dtype;
  return false;
}

// The rows layout back, through the GEMM's own lookups: bf16 [n, K] into `out`.
void unpack_rows(const Tensor& packed, int64_t n, Tensor& out) {
#if defined(__AVX512F__)
  const int64_t panels = packed.size(0), blocks = packed.size(1), k = blocks * kBlockK;
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  alignas(64) uint16_t rows[kOutputs * kBlockK];
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t width = std::min(kOutputs, n - p * kOutputs);
    for (int64_t b = 0; b < blocks; ++b) {
      dequant_rows(packed.data_ptr<uint8_t>() + (p * blocks + b) * kRowsBlockBytes, rows);
      for (int64_t r = 0; r < width; ++r) std::memcpy(o + (p * kOutputs + r) * k + b * kBlockK, rows + r * kBlockK, 64);
    }
  }
#else
  (void)packed, (void)n, (void)out;
#endif
}

Tensor unpack(const Tensor& packed, int64_t n, at::ScalarType dtype) {
  const bool rows = is_rows_layout(packed);
  if (rows) {
    TORCH_CHECK(dtype == at::kBFloat16 && rows_op_supported(), kOp,
                "_unpack: the rows layout is bf16 on AMX CPUs with AVX512-VBMI only");
  } else {
    TORCH_CHECK(supported(dtype), kOp, "_unpack: no ", dtype, " panels on this CPU (or build)");
    TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    type_of(packed.size(2)) >= 0,
                kOp, "_unpack: packed must come from quant_panels_pack or quant_rows_pack");
  }
  const int64_t panels = packed.size(0), blocks = packed.size(1), k = blocks * kBlockK;
  TORCH_CHECK(n > (panels - 1) * kOutputs && n <= panels * kOutputs, kOp, "_unpack: N = ", n,
              " does not fit ", panels, " panels");
  Tensor out = at::empty({n, k}, packed.options().dtype(dtype));
  if (rows) {
    unpack_rows(packed, n, out);
    return out;
  }
  const Panels w = Panels::of(packed.data_ptr<uint8_t>(), blocks, packed.size(2));
#if defined(__AVX512F__)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t width = std::min(kOutputs, n - p * kOutputs);
    if (dtype == at::kFloat) {
      const float* panel = f32_panel(w, p);
      float* o = out.data_ptr<float>() + p * kOutputs * k;
      for (int64_t r = 0; r < width; ++r) {
        for (int64_t c = 0; c < k; ++c) o[r * k + c] = panel[c * kOutputs + r];
      }
    } else if (!__builtin_cpu_supports("avx512bf16")) {  // what the "avx512f" kernel multiplies by
      const float* panel = f32_panel<true>(w, p);
      auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()) + p * kOutputs * k;
      for (int64_t r = 0; r < width; ++r) {
        for (int64_t c = 0; c < k; ++c) {
          uint32_t bits;
          std::memcpy(&bits, panel + c * kOutputs + r, 4);
          o[r * k + c] = static_cast<uint16_t>(bits >> 16);  // rounded already: the top half is the bf16
        }
      }
    } else {
      const uint16_t* panel = bf16_panel(w, p);
      auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()) + p * kOutputs * k;
      for (int64_t r = 0; r < width; ++r) {
        for (int64_t c = 0; c < k; ++c) o[r * k + c] = panel[(c / 2 * kOutputs + r) * 2 + c % 2];
      }
    }
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def("quant_panels_pack(Tensor raw, int type, int k) -> Tensor");
  m.def("quant_panels_unpack(Tensor packed, int n, ScalarType dtype) -> Tensor");
  m.def("quant_panels_supported(ScalarType dtype) -> bool", &supported);
  m.def("quant_rows_pack(Tensor raw, int type, int k) -> Tensor");
  m.def("quant_rows_supported() -> bool", &rows_op_supported);
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) {
  m.impl("quant_panels_pack", &pack);
  m.impl("quant_panels_unpack", &unpack);
  m.impl("quant_rows_pack", &pack_rows);
}
