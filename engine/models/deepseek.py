"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over a latent paged cache, plus MoE.

The cache holds one vector per token, [kv_c (kv_lora_rank) | k_pe (qk_rope_head_dim)];
keys and values are re-derived from kv_c with kv_b_proj when attention reads it.
Prefill up-projects the latents (as transformers does); decode folds kv_b_proj
into the query and output instead ("absorbed"), so it never expands the cache.
Both read latents through the block tables and mask after reading, exactly as
engine.ops.attention.paged_attention does, so a NaN in the null block propagates.
A fixed-shape (CUDA-graph) decode step reads the whole table width through FlexAttention
with the lengths on the device (engine/ops/flex_attention.py), the latent cache as one
shared KV head: the same read-then-mask, no host-side length.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.ops import cpu_ops, flex_attention
from engine.ops.attention import AttentionMetadata, attend, gather_kv
from engine.ops.attention_backends import AttentionBackend, CpuKernelBackend, select
from engine.config import EngineConfig
from engine.ops.kv_writer import write_mla
from engine.models.expert_parallel import ExpertParallel
from engine.models.layers import Linear, RMSNorm, SiluMLP, StepContext
from engine.models.rotary import inverse_frequencies, rope_parameters, rotate_half, yarn_get_mscale
from engine.models.moe import (DeepseekV2Router, DeepseekV3Router, KeepsFloat32, MoECausalLM,
                               SharedExpertsMoeBlock, StackedExperts)

# transformers' config defaults where V2 and V3 differ (hand-written config.json files may omit them).
_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.0,
                                  norm_topk_prob=False, topk_method="greedy", n_group=None, topk_group=None),
    "DeepseekV3ForCausalLM": dict(first_k_dense_replace=3, n_shared_experts=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, topk_method="noaux_tc", n_group=8, topk_group=4,
                                  rope_interleave=True),
}


def _hf(config: EngineConfig, key: str) -> Any:
    hf = config.model.hf_config
    return hf[key] if key in hf else _DEFAULTS[config.model.architecture].get(key)


def mla_softmax_scale(hf: dict[str, Any], qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared when set."""
    params = rope_parameters(hf)
    scale = qk_head_dim ** -0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        mscale = yarn_get_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class DeepseekRotary(KeepsFloat32):
    """RoPE on the rope part of q and k in DeepSeek's layouts (tables stay float32):
    - "complex" (V2): adjacent pairs as complex numbers, computed in float32;
    - "interleave" (V3, rope_interleave): adjacent pairs in, [evens | odds] out;
    - "neox" (V3 without rope_interleave): rotate-half.
    """

    def __init__(self, dim: int, max_positions: int, hf: dict[str, Any], style: str):
        super().__init__()
        params = rope_parameters(hf)
        inv_freq, scaling = inverse_frequencies(dim, params, hf.get("max_position_embeddings", 2048))
        self.style = style
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, dim // 2]
        if style == "complex":
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs) * scaling,
                                 persistent=False)
        else:
            emb = torch.cat([freqs, freqs], dim=-1)
            self.register_buffer("cos", emb.cos() * scaling, persistent=False)
            self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor,  # [T]
                q: torch.Tensor,                # [T, num_heads, dim]
                k: torch.Tensor,                # [T, dim]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.style == "complex":
            freqs = self.freqs_cis[positions]   # [T, dim // 2] complex64
            q_c = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
            k_c = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
            q_out = torch.view_as_real(q_c * freqs[:, None]).flatten(-2).to(q.dtype)
            k_out = torch.view_as_real(k_c * freqs).flatten(-2).to(k.dtype)
            return q_out, k_out
        cos, sin = self.cos[positions].to(q.dtype), self.sin[positions].to(q.dtype)  # [T, dim]
        if self.style == "neox":
            return (q * cos[:, None] + rotate_half(q) * sin[:, None], k * cos + rotate_half(k) * sin)
        half = cos.shape[-1] // 2
        cos, sin = cos[:, :half], sin[:, :half]
        return _rotate_pairs(q, cos[:, None], sin[:, None]), _rotate_pairs(k, cos, sin)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAAttention(nn.Module):
    def __init__(self, config: EngineConfig, layer_index: int):
        super().__init__()
        mc, hf = config.model, config.model.hf_config
        self.layer_index = layer_index
        self.num_heads = mc.num_heads
        self.nope_dim, self.rope_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        self.v_dim, self.kv_lora_rank = hf["v_head_dim"], hf["kv_lora_rank"]
        self.q_lora_rank = hf.get("q_lora_rank")
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(hf.get("attention_bias", False))
        hidden = mc.hidden_size
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # HF: default eps, not rms_norm_eps
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        else:
            self.q_proj = Linear(hidden, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False,
                                keep_weight=True)  # decode folds it into q and the output
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        if mc.architecture == "DeepseekV2ForCausalLM":
            style = "complex"
        else:
            style = "interleave" if _hf(config, "rope_interleave") else "neox"
        self.rotary = DeepseekRotary(self.rope_dim, config.max_model_len, hf, style)
        self.scale = mla_softmax_scale(hf, qk_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)                      # [T, kv_lora_rank]
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)       # [T, H, rope], [T, rope]
        cache = ctx.kv_caches[self.layer_index]               # [num_blocks, block_size, kv_lora_rank + rope]
        write_mla(kv_c, k_pe, cache, ctx.meta.slot_mapping, ctx.null_block_writes, guard=ctx.write_guard)
        out = self._decode(q_nope, q_pe, cache, ctx.meta, ctx.attention)
        self._prefill(q_nope, q_pe, cache, ctx.meta, out)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata, out: torch.Tensor) -> None:  # out: [T, H, v_dim]
        """Requests past the leading decodes, one by one: expand their latents to per-head
        keys/values, causal attention."""
        block_size = cache.shape[1]
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(meta.num_decodes, meta.num_reqs):
            q_start, q_end, seq_len = starts[i], starts[i + 1], lens[i]
            num_new = q_end - q_start
            latent = gather_kv(cache, meta.block_tables[i:i + 1, :-(-seq_len // block_size)])[0]  # [L, D]
            length = latent.shape[0]
            kv = self.kv_b_proj(latent[:, :self.kv_lora_rank]).view(length, self.num_heads, -1)
            k_nope, value = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k_pe = latent[:, None, self.kv_lora_rank:].expand(length, self.num_heads, self.rope_dim)
            key = torch.cat([k_nope, k_pe], dim=-1)                              # [L, H, qk]
            query = torch.cat([q_nope[q_start:q_end], q_pe[q_start:q_end]], dim=-1)  # [n, H, qk]
            q_pos = torch.arange(seq_len - num_new, seq_len, device=query.device)
            k_pos = torch.arange(length, device=query.device)
            allowed = (k_pos[None, :] <= q_pos[:, None]).view(1, 1, num_new, length)
            attn = attend(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                           value.transpose(0, 1)[None], allowed, self.scale)     # [1, H, n, v]
            out[q_start:q_end] = attn[0].transpose(0, 1)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend | None = None) -> torch.Tensor:  # [T, H, v_dim]
        """One query per request, batched: kv_b_proj folded into q and the output, so every
        head attends over the shared latent vectors themselves (q.k = q_nope W_uk . kv_c + q_pe . k_pe)."""
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_dim)
        num_reqs = meta.num_decodes  # the leading one-token requests (rows [0, num_reqs))
        if num_reqs == 0:
            return out
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv[:, :self.nope_dim], w_kv[:, self.nope_dim:]              # [H, nope|v, R]
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope[:num_reqs], w_uk)
        query = torch.cat([q_latent, q_pe[:num_reqs]], dim=-1)                     # [B, H, R + rope]
        if meta.fixed_shape:
            # Every row (padded ones: length 0, a null table row) reads the whole table width and
            # masks past its length on the device, after the read; a fully masked row comes out 0.
            out_latent = flex_attention.paged_decode_attention(
                query, cache.unsqueeze(2), cache[..., :self.kv_lora_rank].unsqueeze(2), meta.block_tables,
                meta.seq_lens, self.scale)                                         # [B, H, R]
            return torch.einsum("bhr,hvr->bhv", out_latent, w_uv)
        num_read = -(-meta.max_decode_seq_len // cache.shape[1])
        # The backend chosen at load says whether csrc/cpu/'s decode kernel runs here; the call
        # stays MLA's own (one shared latent head, every row reading the batch's longest).
        backend = backend or select(cache.device, query.dtype, cache.dtype)
        if isinstance(backend, CpuKernelBackend) and cache.dtype == query.dtype:
            # The latent cache is one shared kv head (keys: the whole row, values: its first R
            # entries): MQA for the CPU kernel, every row reading the batch's longest, as below.
            out_latent = query.new_empty(num_reqs, self.num_heads, self.kv_lora_rank)
            cpu_ops.paged_decode_attention(out_latent, query, cache.unsqueeze(2),
                                           cache[..., :self.kv_lora_rank].unsqueeze(2), meta.block_tables,
                                           meta.seq_lens, None, num_read, self.scale)
            out[:num_reqs] = torch.einsum("bhr,hvr->bhv", out_latent, w_uv)
            return out
        latent = gather_kv(cache, meta.block_tables[:num_reqs, :num_read])           # [B, L, R + rope]
        positions = torch.arange(latent.shape[1], device=latent.device)
        allowed = (positions[None, :] < meta.seq_lens[:num_reqs, None]).view(num_reqs, 1, 1, -1)
        # Heads take the place of query positions: one shared latent "head" serves them all.
        out_latent = attend(query[:, None], latent[:, None], latent[:, None, :, :self.kv_lora_rank],
                             allowed, self.scale)[:, 0]                            # [B, H, R]
        out[:num_reqs] = torch.einsum("bhr,hvr->bhv", out_latent, w_uv)
        return out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: EngineConfig, layer_index: int, ep: ExpertParallel):
        super().__init__()
        hf, hidden = config.model.hf_config, config.model.hidden_size
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only silu is supported, got {hf['hidden_act']!r}")
        eps = hf.get("rms_norm_eps", 1e-6)
        self.self_attn = MLAAttention(config, layer_index)
        self.mlp = _make_mlp(config, layer_index, ep)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _make_mlp(config: EngineConfig, layer_index: int, ep: ExpertParallel) -> nn.Module:
    hf, hidden = config.model.hf_config, config.model.hidden_size
    # transformers ignores moe_layer_freq; DeepSeek's own code applies it (1 in every release).
    is_moe = (layer_index >= _hf(config, "first_k_dense_replace")
              and layer_index % hf.get("moe_layer_freq", 1) == 0)
    if not is_moe:
        return SiluMLP(hidden, hf["intermediate_size"], bias=bool(hf.get("mlp_bias", False)))
    num_experts, top_k = config.model.num_experts, hf["num_experts_per_tok"]
    if config.model.architecture == "DeepseekV2ForCausalLM":
        gate = DeepseekV2Router(hidden, num_experts, top_k, _hf(config, "topk_method"), _hf(config, "n_group"),
                                _hf(config, "topk_group"), _hf(config, "routed_scaling_factor"))
    else:
        gate = DeepseekV3Router(hidden, num_experts, top_k, _hf(config, "n_group"), _hf(config, "topk_group"),
                                _hf(config, "norm_topk_prob"), _hf(config, "routed_scaling_factor"))
    inter = hf["moe_intermediate_size"]
    experts = StackedExperts(hidden, inter, ep.expert_range(num_experts))
    num_shared = _hf(config, "n_shared_experts")
    shared = SiluMLP(hidden, inter * num_shared, bias=bool(hf.get("mlp_bias", False))) if num_shared else None
    return SharedExpertsMoeBlock(gate, experts, ep, shared)


def deepseek_for_causal_lm(config: EngineConfig) -> MoECausalLM:
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM."""
    return MoECausalLM(config, DeepseekDecoderLayer)
