// What cpu_f32_gemm.cpp lends the bf16 GEMM (cpu_bf16_gemm.cpp): on CPUs with AVX-512F but no
// AVX512-BF16 a bf16 model's GGUF-quantized linears run through the float32 GEMM's loops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace kvsentry_f32 {

// Built with AVX-512 and the CPU has AVX-512F.
bool supported();

// y [M, N] bf16 = x [M, K] bf16 . W^T + bias, W quant_panels_pack's blocks dequantized and
// rounded to bf16 (the bf16 model's weight): the float32 GEMM on the exact values, summing K
// in order by fused multiply-adds and adding the bias last, then rounded once to bf16.
at::Tensor bf16_quant_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                           int64_t n);

}  // namespace kvsentry_f32
