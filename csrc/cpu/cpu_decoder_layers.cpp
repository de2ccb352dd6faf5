// A dense decoder's whole layer stack as one op on CPU: the same kernels, none of the Python.
//
//   hidden = torch.ops.kvsentry.dense_decoder_layers(hidden, positions, weights, biases, qk_norms,
//       k_caches, v_caches, cos, sin, slot_mapping, null_block_writes,
//       decode_tables, decode_seq_lens, decode_reads, decode_num_read, num_decodes,
//       prefill_tables, prefill_seq_lens, prefill_reads, prefill_num_read, prefill_first, prefill_last,
//       num_heads, num_kv_heads, head_dim, eps, scale)
//
//     hidden       [T, N] float32 or bfloat16, contiguous: the embeddings (T counts padding rows)
//     positions    [T] int64
//     weights      6 per layer: input norm [N], q|k|v packed, o packed, post-attention norm [N],
//                  gate|up packed, down packed (engine/models/cpu_gemm.py's PackedLinear): each
//                  linear is oneDNN's packed weight or panels: bf16_gemm's (csrc/cpu/cpu_bf16_gemm.cpp)
//                  or f32_gemm's (csrc/cpu/cpu_f32_gemm.cpp), or GGUF blocks for int8_gemm
//                  (csrc/cpu/cpu_int8_gemm.cpp)
//     biases       4 per layer (None where the layer has none): q|k|v, o, gate|up, down
//     out_features 4 per layer: the linears' output widths (panels are padded to 64)
//     qk_norms     2 per layer (Qwen3's per-head q and k norms [D]) or none at all
//     k/v_caches   per layer [num_blocks, block_size, Hkv, D], any strides (the head-major CPU layout)
//     cos, sin     [P, D] rotary tables; slot_mapping [T] int64 (PAD_SLOT_ID = -1 skips a row)
//     decode_*     the one-query rows [0, num_decodes): tables, lengths, entries each reads
//     prefill_*    rows [prefill_first, prefill_last): prefill tokens as one-query rows
//                  (engine/ops/attention.py's PrefillPlan); prefill_last == prefill_first: none
//     prefill_tile_seq_lens, prefill_tile_starts (optional): the prefill requests' chunks run
//                  through paged_prefill_attention instead (csrc/cpu/cpu_prefill_attention.cpp):
//                  prefill_tables then holds one row per request, these their lengths and
//                  query_starts (attention.py's prefill_in_tiles path)
//     returns      the hidden state after the last layer (before the final norm), [T, N]
//
// Why: a 30-layer model at batch 1 runs ~15 ops per layer from Python, ~2 ms of interpreter
// and dispatch per step, a fifth of a 10 ms decode step. This op runs the layer loop of
// engine/models/llama.py (DecoderLayer, Attention, SiluMLP) op for op, through the
// dispatcher: the same oneDNN linears, the same kvsentry kernels, the same aten ops for what
// Python runs as torch references (Qwen3's 3-d q/k norms, the residual add), in the same
// order. So it gives the Python loop's bits exactly; tests/csrc/test_decoder_layers.py holds it
// to that, and engine/models/fused_stack.py falls back to the loop wherever a step needs what
// this op does not do (SDPA prefill chunks, hooks, other layer kinds, enforce_eager).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
constexpr const char* kOp = "kvsentry::dense_decoder_layers";

// The ops a layer runs, looked up once. Typed handles where the signature is ours; oneDNN's
// linear is called boxed when its C++ signature is not the one spelled here (it changed
// between torch releases), typed otherwise (a boxed call costs ~1 us more, x 121 per step).
struct LayerOps {
  using LinearSig = Tensor(const Tensor&, const Tensor&, const OptTensor&, c10::string_view,
                           c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>);
  c10::OperatorHandle linear_boxed;
  std::optional<c10::TypedOperatorHandle<LinearSig>> linear_typed;
  using PanelSig = Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t);
  c10::TypedOperatorHandle<PanelSig> panel_gemm;      // bf16 panels
  c10::TypedOperatorHandle<PanelSig> f32_panel_gemm;  // float32 panels
  c10::TypedOperatorHandle<PanelSig> int8_gemm;       // GGUF blocks with int8 activations
  c10::TypedOperatorHandle<PanelSig> int8_gemm_parts;  // the same, in parts of several GGML types
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>
      add_rms_norm;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                      const Tensor&)>
      rotary;
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul;
  c10::TypedOperatorHandle<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const OptTensor&, int64_t, double)>
      attention;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&, const OptTensor&,
                                const OptTensor&)>
      write_kv;
  c10::TypedOperatorHandle<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, at::IntArrayRef,
                                at::IntArrayRef, double)>
      prefill_attention;

  static c10::OperatorHandle find(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  }

  LayerOps()
      : linear_boxed(find("mkldnn::_linear_pointwise")),
        panel_gemm(find("kvsentry::bf16_gemm").typed<PanelSig>()),
        f32_panel_gemm(find("kvsentry::f32_gemm").typed<PanelSig>()),
        int8_gemm(find("kvsentry::int8_gemm").typed<PanelSig>()),
        int8_gemm_parts(find("kvsentry::int8_gemm_parts").typed<PanelSig>()),
        rms_norm(find("kvsentry::rms_norm").typed<Tensor(const Tensor&, const Tensor&, double)>()),
        add_rms_norm(find("kvsentry::add_rms_norm")
                         .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>()),
        rotary(find("kvsentry::rotary")
                   .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                     const Tensor&)>()),
        silu_and_mul(find("kvsentry::silu_and_mul").typed<Tensor(const Tensor&)>()),
        attention(find("kvsentry::paged_decode_attention")
                      .typed<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const OptTensor&, int64_t, double)>()),
        write_kv(find("kvsentry::reshape_and_cache_flash")
                     .typed<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&, const OptTensor&,
                                 const OptTensor&)>()),
        prefill_attention(find("kvsentry::paged_prefill_attention")
                              .typed<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                          at::IntArrayRef, at::IntArrayRef, double)>()) {
    try {
      linear_typed = linear_boxed.typed<LinearSig>();
    } catch (const c10::Error&) {
      linear_typed = std::nullopt;
    }
  }

  // PackedLinear.__call__: for panels (a plain tensor; the stack takes no other),
  // bf16_gemm(x, panels, bias, out_features) or f32_gemm by x's dtype (GGUF-quantized panels
  // are uint8, and either GEMM takes them); else
  // mkldnn._linear_pointwise(x, weight, bias, "none", [None], "").
  Tensor linear(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t out_features) const {
    // cpu_int8_gemm.cpp's packed blocks: uint8 [groups, blocks, 288 | 320 | 352 | 544 | 2368 | 3360]
    // (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), never a panel block's size (cpu_quant_panels.h: 1280, 2176).
    const int64_t int8_bytes = weight.dim() == 3 ? weight.size(2) : 0;
    if (!weight.is_mkldnn() && weight.scalar_type() == at::kByte &&
        (int8_bytes == 288 || int8_bytes == 320 || int8_bytes == 352 || int8_bytes == 544 || int8_bytes == 2368 ||
         int8_bytes == 3360)) {
      return int8_gemm.call(x, weight, bias, out_features);
    }
    // int8_gemm_parts' vector of parts (a q|k|v of several GGML types).
    if (!weight.is_mkldnn() && weight.scalar_type() == at::kByte && weight.dim() == 1) {
      return int8_gemm_parts.call(x, weight, bias, out_features);
    }
    if (!weight.is_mkldnn()) {
      return (x.scalar_type() == at::kFloat ? f32_panel_gemm : panel_gemm).call(x, weight, bias, out_features);
    }
    if (linear_typed.has_value()) {
      c10::List<std::optional<c10::Scalar>> scalars;
      scalars.push_back(std::nullopt);
      return linear_typed->call(x, weight, bias, "none", std::move(scalars), c10::string_view(""));
    }
    torch::jit::Stack stack;
    stack.reserve(6);
    stack.emplace_back(x);
    stack.emplace_back(weight);
    stack.emplace_back(bias);
    stack.emplace_back(std::string("none"));
    c10::List<std::optional<c10::Scalar>> scalars;
    scalars.push_back(std::nullopt);
    stack.emplace_back(std::move(scalars));
    stack.emplace_back(std::string(""));
    linear_boxed.callBoxed(&stack);
    return stack[0].toTensor();
  }
};

const LayerOps& layer_ops() {
  static const LayerOps ops;  // after every kvsentry op is registered: the first call, not load time
  return ops;
}

// rms_norm_reference (engine/ops/fused_ops.py) over the last dim, as Python runs it for a 3-d
// per-head q or k: weight * (h * rsqrt(mean(h^2) + eps)).to(dtype), h = x.float().
Tensor reference_rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const Tensor h = x.to(at::kFloat);
  const Tensor normed = at::mul(h, at::rsqrt(at::add(at::mean(at::pow(h, 2), {-1}, true), eps)));
  return at::mul(weight, normed.to(x.scalar_type()));
}

// The Python fallback's contiguous_rows (engine/ops/cuda_ops.py).
Tensor contiguous_rows(const Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

using OptTensorList = c10::List<OptTensor>;

void check(const Tensor& hidden, const Tensor& positions, at::TensorList weights, const OptTensorList& biases,
           at::IntArrayRef out_features, const OptTensorList& qk_norms, at::TensorList k_caches, at::TensorList v_caches, int64_t num_decodes,
           int64_t prefill_first, int64_t prefill_last, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 2 && hidden.is_contiguous() &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              kOp, ": hidden must be a contiguous CPU float32 or bfloat16 [T, N] tensor");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == hidden.size(0) && positions.scalar_type() == at::kLong,
              kOp, ": positions must be int64 [T]");
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == layers, kOp, ": one v cache per k cache");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * layers, kOp, ": weights must hold 6 tensors per layer, got ",
              weights.size(), " for ", layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(biases.size()) == 4 * layers, kOp, ": biases must hold 4 entries per layer");
  TORCH_CHECK(static_cast<int64_t>(out_features.size()) == 4 * layers, kOp,
              ": out_features must hold 4 entries per layer");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers, kOp,
              ": qk_norms must be empty or hold 2 entries per layer");
  for (size_t i = 0; i < qk_norms.size(); ++i) {
    TORCH_CHECK(qk_norms.get(i).has_value(), kOp, ": qk_norms entries must be tensors");
  }
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0, kOp,
              ": bad head counts");
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= hidden.size(0) && prefill_first >= num_decodes &&
                  prefill_last >= prefill_first && prefill_last <= hidden.size(0),
              kOp, ": attention rows out of range");
}

Tensor dense_decoder_layers_cpu(const Tensor& hidden_in, const Tensor& positions, at::TensorList weights,
                                const OptTensorList& biases, at::IntArrayRef out_features,
                                const OptTensorList& qk_norms,
                                at::TensorList k_caches, at::TensorList v_caches, const Tensor& cos,
                                const Tensor& sin, const Tensor& slot_mapping, const OptTensor& null_block_writes,
                                const OptTensor& decode_tables, const OptTensor& decode_seq_lens,
                                const OptTensor& decode_reads, int64_t decode_num_read, int64_t num_decodes,
                                const OptTensor& prefill_tables, const OptTensor& prefill_seq_lens,
                                const OptTensor& prefill_reads, int64_t prefill_num_read, int64_t prefill_first,
                                int64_t prefill_last, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                double eps, double scale, at::OptionalIntArrayRef prefill_tile_seq_lens,
                                at::OptionalIntArrayRef prefill_tile_starts) {
  check(hidden_in, positions, weights, biases, out_features, qk_norms, k_caches, v_caches, num_decodes,
        prefill_first, prefill_last, num_heads, num_kv_heads, head_dim);
  TORCH_CHECK(num_decodes == 0 || (decode_tables.has_value() && decode_seq_lens.has_value()), kOp,
              ": decode rows need their tables and lengths");
  const bool tile_prefill = prefill_tile_seq_lens.has_value();
  TORCH_CHECK(tile_prefill == prefill_tile_starts.has_value(), kOp,
              ": prefill_tile_seq_lens and prefill_tile_starts go together");
  TORCH_CHECK(prefill_last == prefill_first || (prefill_tables.has_value() && (tile_prefill || prefill_seq_lens.has_value())),
              kOp, ": prefill rows need their tables and lengths");
  const LayerOps& ops = layer_ops();
  const int64_t tokens = hidden_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const bool qk_norm = !qk_norms.empty();
  // Rows no attention call writes, zeroed (padding rows stay zero, as paged_attention leaves
  // them): past the last decode or prefill row, and any gap between the two. (With
  // prefill_amx_*, prefill_first and prefill_last still bound the prefill rows.)
  const int64_t covered = std::max(num_decodes, prefill_last);
  const int64_t gap_end = prefill_last > prefill_first ? prefill_first : num_decodes;
  Tensor hidden = hidden_in;
  Tensor mlp;  // the previous layer's MLP output, added into the residual by the next norm
  for (size_t l = 0; l < k_caches.size(); ++l) {
    const Tensor* w = &weights[6 * l];
    const OptTensor b[4] = {biases.get(4 * l), biases.get(4 * l + 1), biases.get(4 * l + 2), biases.get(4 * l + 3)};
    const int64_t* n = &out_features[4 * l];
    Tensor k_cache = k_caches[l];  // a handle: the op writes the cache's storage
    Tensor v_cache = v_caches[l];
    // Attention (engine/models/llama.py, Attention.forward)
    // The MLP's residual add fused into this layer's input norm: add_rms_norm's sum and norm
    // are bitwise at::add then rms_norm (tests/csrc/test_fused_ops.py), one pass instead of two.
    Tensor normed_in;
    if (mlp.defined()) {
      std::tie(normed_in, hidden) = ops.add_rms_norm.call(mlp, hidden, w[0], eps);
    } else {
      normed_in = ops.rms_norm.call(hidden, w[0], eps);
    }
    const Tensor qkv = ops.linear(normed_in, w[1], b[0], n[0]);
    Tensor q = qkv.narrow(1, 0, q_size).reshape({tokens, num_heads, head_dim});
    Tensor k = qkv.narrow(1, q_size, kv_size).reshape({tokens, num_kv_heads, head_dim});
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).reshape({tokens, num_kv_heads, head_dim});
    if (qk_norm) {
      q = reference_rms_norm(q, *qk_norms.get(2 * l), eps);
      k = reference_rms_norm(k, *qk_norms.get(2 * l + 1), eps);
    }
    std::tie(q, k) = ops.rotary.call(q, k, cos, sin, positions);
    ops.write_kv.call(contiguous_rows(k), contiguous_rows(v), k_cache, v_cache, slot_mapping, null_block_writes,
                      std::nullopt);
    // paged_attention (engine/ops/attention.py): padding rows stay zero.
    Tensor out = at::empty({tokens, num_heads, v_cache.size(-1)}, q.options());
    if (covered < tokens) out.narrow(0, covered, tokens - covered).zero_();
    if (gap_end > num_decodes) out.narrow(0, num_decodes, gap_end - num_decodes).zero_();
    if (num_decodes > 0) {
      Tensor rows = out.narrow(0, 0, num_decodes);
      ops.attention.call(rows, q.narrow(0, 0, num_decodes), k_cache, v_cache, *decode_tables, *decode_seq_lens,
                         decode_reads, decode_num_read, scale);
    }
    if (tile_prefill) {  // the requests' chunks on the prefill kernel's tiles (prefill_tables: a row a request)
      ops.prefill_attention.call(out, q, k_cache, v_cache, *prefill_tables, *prefill_tile_seq_lens,
                                 *prefill_tile_starts, scale);
    } else if (prefill_last > prefill_first) {
      Tensor rows = out.narrow(0, prefill_first, prefill_last - prefill_first);
      ops.attention.call(rows, q.narrow(0, prefill_first, prefill_last - prefill_first), k_cache, v_cache,
                         *prefill_tables, *prefill_seq_lens, prefill_reads, prefill_num_read, scale);
    }
    const Tensor attn = ops.linear(out.view({tokens, num_heads * v_cache.size(-1)}), w[2], b[1], n[1]);
    // DecoderLayer.forward: the residual add fused into the post-attention norm, then the MLP.
    Tensor normed;
    std::tie(normed, hidden) = ops.add_rms_norm.call(attn, hidden, w[3], eps);
    mlp = ops.linear(ops.silu_and_mul.call(ops.linear(normed, w[4], b[2], n[2])), w[5], b[3], n[3]);
  }
  return mlp.defined() ? at::add(hidden, mlp) : hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsentry, m) {
  m.def(
      "dense_decoder_layers(Tensor hidden, Tensor positions, Tensor[] weights, Tensor?[] biases, "
      "int[] out_features, Tensor?[] qk_norms, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor cos, Tensor sin, "
      "Tensor slot_mapping, Tensor(c!)? null_block_writes, Tensor? decode_tables, Tensor? decode_seq_lens, "
      "Tensor? decode_reads, int decode_num_read, int num_decodes, Tensor? prefill_tables, "
      "Tensor? prefill_seq_lens, Tensor? prefill_reads, int prefill_num_read, int prefill_first, "
      "int prefill_last, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, "
      "int[]? prefill_tile_seq_lens=None, int[]? prefill_tile_starts=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvsentry, CPU, m) { m.impl("dense_decoder_layers", &dense_decoder_layers_cpu); }

// The packed weights are oneDNN (MkldnnCPU) tensors, and the dispatcher picks the highest key
// among all arguments: the same CPU implementation serves it.
TORCH_LIBRARY_IMPL(kvsentry, MkldnnCPU, m) { m.impl("dense_decoder_layers", &dense_decoder_layers_cpu); }
