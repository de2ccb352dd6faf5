// What cpu_f32_gemm.cpp lends the bf16 GEMM (cpu_bf16_gemm.cpp): on CPUs with AVX-512F but no
// AVX512-BF16 a bf16 model's GGUF-quantized linears run through the float32 GEMM's loops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "cpu_quant_panels.h"

namespace kvsentry_f32 {

// Built with AVX-512 and the CPU has AVX-512F.
bool supported();

// y [M, N] float32 = x [M, K] . W^T + bias, x float32 (contiguous; a bf16 x widened, exactly)
// and W quant_panels_pack's blocks (`panels` of them) dequantized and rounded to bf16 (the bf16
// model's weight): the float32 GEMM on the exact values, summing K in order by fused
// multiply-adds and adding the bias (float32, or null) last. The caller rounds y to bf16 once.
at::Tensor bf16_quant_gemm(const at::Tensor& xf, const kvsentry_quant::Panels& quant, int64_t panels,
                           const float* bias, int64_t n);

}  // namespace kvsentry_f32
