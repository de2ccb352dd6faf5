// The AMX-INT8 path of int8_gemm (cpu_int8_gemm_amx.cpp), which cpu_int8_gemm.cpp's op takes for
// the batches it fits, after quantizing the activations as for its AVX512-VNNI kernel.
#pragma once

#include <cstdint>

namespace kvsentry_int8 {

// Whether the AMX path multiplies a batch of m rows by blocks of GGML type `type`: Q4_0, Q4_1 or
// Q8_0, at least amx_min_rows() rows, and a CPU (and build, and process) with AMX-INT8.
bool amx_takes(int64_t type, int64_t m);

// y [m, n] float32 = the quantized rows times int8_gemm_pack's blocks of `type` (+ bias [n] or
// nullptr), the bits of the VNNI kernel and of engine/models/int8_reference.py.
//   packed [groups, blocks, packed block bytes]; q [m rounded up to 16, blocks * 32] int8 starting
//   on a cache line, rows past m zero (a tile reads 16 rows); dx, sx [m, blocks] float32.
void amx_gemm(int64_t type, const uint8_t* packed, int64_t groups, int64_t blocks, const int8_t* q, const float* dx,
              const float* sx, int64_t m, const float* bias, float* y, int64_t n);

}  // namespace kvsentry_int8
