// Rows of a weight in the int8 GEMM's packed layout (cpu_int8_gemm.cpp's header), read back as the
// values ggml dequantizes them to: a tied token embedding gathers its rows from the LM head's
// packed blocks (engine/models/block_embedding.py), the rank's only copy of them.
//
//   values = torch.ops.kvsentry.int8_gemm_rows(packed, ids)
//            packed [ceil(N / 16), K / 32, block bytes'] uint8 of Q4_0, Q4_1, Q5_0 or Q8_0 (the
//            formats of blocks of 32), ids [T] int64 in [0, 16 * groups) -> [T, K] float32
//
// Each value is block_values' (engine/models/int8_reference.py): d * q in float32, and Q4_1's
// d * q + m. A float16 scale times a quant of at most 8 bits is exact in float32, so whether a
// compiler fuses Q4_1's multiply and add changes nothing: one rounding either way, torch's.
// Why an op: the same gather in torch ops (packed_blocks) took ~120 us a decode step of one
// token, 3% of the default model's step; here it is a few microseconds. K-quants keep that path.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstring>

#include "cpu_int8_gemm.h"

namespace {

using at::Tensor;
using namespace kvsentry_int8::layout;
constexpr const char* kOp = "kvsentry::int8_gemm_rows";

float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// One packed block's 32 values of output r (lane r of its group) into out[0, 32).
template <int64_t kType>
void block_row(const uint8_t* block, int64_t r, float* out) {
  const float d = half_at(block + 2 * r);
  const uint8_t* quants = block + scale_bytes(kType);
  for (int64_t k = 0; k < 32; ++k) {
    int32_t q;
    if constexpr (kType == kQ8_0) {
      // Vector k / 4 holds K = 4c + j at byte 4r + j, plus 128.
      q = static_cast<int32_t>(quants[(k / 4) * 64 + 4 * r + k % 4]) - 128;
    } else {
      // Vector c: byte 4r + j holds K = 4c + j in its low nibble, K = 16 + 4c + j in its high one.
      const int64_t kk = k % 16;
      const uint8_t byte = quants[(kk / 4) * 64 + 4 * r + kk % 4];
      q = k < 16 ? byte & 0x0F : byte >> 4;
      if constexpr (kType == kQ5_0) {
        // The fifth bits' vector: bit c of byte 4r + j for K = 4c + j, bit 4 + c for K = 16 + 4c + j.
        const uint8_t high = quants[256 + 4 * r + kk % 4];
        q |= ((high >> ((k < 16 ? 0 : 4) + kk / 4)) & 1) << 4;
        q -= 16;
      }
      if constexpr (kType == kQ4_0) q -= 8;
    }
    float value = d * static_cast<float>(q);
    if constexpr (kType == kQ4_1) {
      value += half_at(block + 2 * kGroup + 2 * r);
    }
    out[k] = value;
  }
}

template <int64_t kType>
void gather(const uint8_t* packed, int64_t blocks, const int64_t* ids, int64_t count, float* out) {
  const int64_t bytes = packed_bytes(kType);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t group = ids[t] / kGroup, lane = ids[t] % kGroup;
    const uint8_t* row = packed + group * blocks * bytes;
    for (int64_t b = 0; b < blocks; ++b) block_row<kType>(row + b * bytes, lane, out + (t * blocks + b) * kBlockK);
  }
}

Tensor rows(const Tensor& packed, const Tensor& ids_in) {
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              kOp, ": packed must come from int8_gemm_pack");
  const int64_t bytes = packed.size(2);
  int64_t type = -1;
  for (int64_t t : {kQ4_0, kQ4_1, kQ5_0, kQ8_0}) {
    if (packed_bytes(t) == bytes) type = t;
  }
  TORCH_CHECK(type >= 0, kOp, ": packed blocks of ", bytes, " bytes are not Q4_0, Q4_1, Q5_0 or Q8_0");
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, kOp, ": ids must be int64 [T]");
  const Tensor ids = ids_in.contiguous();
  const int64_t count = ids.size(0), blocks = packed.size(1), groups = packed.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < groups * kGroup, kOp, ": id ", id[t], " is past the ", groups * kGroup,
                " rows");
  }
  Tensor out = at::empty({count, blocks * kBlockK}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  if (type == kQ4_0) gather<kQ4_0>(w, blocks, id, count, y);
  if (type == kQ4_1) gather<kQ4_1>(w, blocks, id, count, y);
  if (type == kQ5_0) gather<kQ5_0>(w, blocks, id, count, y);
  if (type == kQ8_0) gather<kQ8_0>(w, blocks, id, count, y);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) { m.def("int8_gemm_rows(Tensor packed, Tensor ids) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) { m.impl("int8_gemm_rows", &rows); }
