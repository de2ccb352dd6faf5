"""Test helper: write an HF checkpoint directory as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py does, so the loader is checked against the converter's conventions,
not against itself. Names come from the `gguf` package's own TensorNameMap; the layout
changes are the converter's: q/k rows permuted for `llama`, experts stacked, DeepSeek's
kv_b_proj split into k_b (transposed) and v_b, Mixtral written as `llama` with experts.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from tests.engine import kquant_blocks

GGUF_ARCH = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2, "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE, "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "DeepseekV2ForCausalLM": gguf.MODEL_ARCH.DEEPSEEK2, "DeepseekV3ForCausalLM": gguf.MODEL_ARCH.DEEPSEEK2,
}
Q = gguf.GGMLQuantizationType
_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight")


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> adjacent pairs."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _metadata(writer: gguf.GGUFWriter, hf: dict, arch: str) -> None:
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_freq_base(hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(hf["vocab_size"])
    scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if arch.startswith("Deepseek"):
        _deepseek_metadata(writer, hf)
        return
    writer.add_head_count_kv(hf["num_key_value_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(hf["num_experts_per_tok"])
        if "moe_intermediate_size" in hf:
            writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        if hf.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])


def llama3_rope_freqs(hf: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs: Llama 3 rope scaling as per-frequency divisors."""
    scaling = hf["rope_scaling"]
    dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    base = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _deepseek_metadata(writer: gguf.GGUFWriter, hf: dict) -> None:
    writer.add_head_count_kv(1)  # MLA as MQA over the latent
    lora, rope = hf["kv_lora_rank"], hf["qk_rope_head_dim"]
    writer.add_key_length(lora + rope)
    writer.add_value_length(lora)
    writer.add_key_length_mla(hf["qk_nope_head_dim"] + rope)
    writer.add_value_length_mla(hf["v_head_dim"])
    writer.add_rope_dimension_count(rope)
    if hf.get("q_lora_rank"):
        writer.add_q_lora_rank(hf["q_lora_rank"])
    writer.add_kv_lora_rank(lora)
    writer.add_leading_dense_block_count(hf["first_k_dense_replace"])
    writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    writer.add_expert_count(hf["n_routed_experts"])
    writer.add_expert_used_count(hf["num_experts_per_tok"])
    writer.add_expert_shared_count(hf["n_shared_experts"])
    writer.add_expert_weights_scale(hf["routed_scaling_factor"])
    if hf.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    sigmoid = hf.get("scoring_func") == "sigmoid"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    # Group-limited routing: V3 always, V2 only with topk_method group_limited_greedy.
    if sigmoid or hf.get("topk_method") == "group_limited_greedy":
        writer.add_expert_group_count(hf.get("n_group") or 1)
        writer.add_expert_group_used_count(hf.get("topk_group") or 1)


def _tensors(state: dict[str, torch.Tensor], hf: dict, arch: str) -> dict[str, torch.Tensor]:
    """HF names -> the converter's HF-side names and layouts (before TensorNameMap)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue
        if m := _EXPERT.fullmatch(name):
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = tensor
            continue
        if GGUF_ARCH[arch] == gguf.MODEL_ARCH.LLAMA and re.search(r"\.(q|k)_proj\.(weight|bias)$", name):
            heads = hf["num_attention_heads"] if ".q_proj." in name else hf["num_key_value_heads"]
            tensor = llama_cpp_permute(tensor, heads)
        if name.endswith("kv_b_proj.weight"):
            heads, v, nope = hf["num_attention_heads"], hf["v_head_dim"], hf["qk_nope_head_dim"]
            kv_b = tensor.view(heads, nope + v, tensor.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2).contiguous()
            out[name.replace("kv_b_proj", "v_b_proj")] = v_b.contiguous()
            continue
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        out[name] = tensor
    for (prefix, proj), per_expert in experts.items():
        out[f"{prefix}.{proj}.weight"] = torch.stack([per_expert[i] for i in sorted(per_expert)])
    return out


def write_gguf(src: str | Path, dst: str | Path,
               qtype: Callable[[str, torch.Tensor], gguf.GGMLQuantizationType] = lambda n, t: Q.F32) -> Path:
    """Convert the HF checkpoint directory `src` into GGUF file `dst`; `qtype(gguf_name, tensor)`
    picks each tensor's type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0: what `gguf` can quantize; Q4_K
    and Q6_K through tests/engine/kquant_blocks.py)."""
    src, dst = Path(src), Path(dst)
    hf = json.loads((src / "config.json").read_text())
    arch = hf["architectures"][0]
    state = {}
    for file in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(file)))
    writer = gguf.GGUFWriter(str(dst), gguf.MODEL_ARCH_NAMES[GGUF_ARCH[arch]])
    _metadata(writer, hf, arch)
    if ((hf.get("rope_scaling") or {}).get("rope_type")) == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(hf))
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], hf["num_hidden_layers"])
    # llama.cpp's qwen2moe has no dense layers; one (mlp_only_layers) keeps the standard names.
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, hf["num_hidden_layers"])
    for name, tensor in _tensors(state, hf, arch).items():
        base, _, suffix = name.rpartition(".")
        mapped = names.get_name(base) or dense_names.get_name(base)
        assert mapped is not None, f"gguf's TensorNameMap has no name for {name}"
        gguf_name = f"{mapped}.{suffix}"
        data = tensor.float().numpy()
        kind = qtype(gguf_name, tensor) if data.ndim > 1 else Q.F32
        if kind == Q.F32:
            writer.add_tensor(gguf_name, data)
        elif kind == Q.F16:
            writer.add_tensor(gguf_name, data.astype(np.float16))
        elif kind in kquant_blocks.QUANTIZERS:
            writer.add_tensor(gguf_name, kquant_blocks.QUANTIZERS[kind](data), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, gguf.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
