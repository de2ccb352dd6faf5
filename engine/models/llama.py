"""Dense decoders: Llama, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Modules carry the Hugging Face names so checkpoint keys map onto parameters 1:1.
Tokens are flattened across requests: every tensor is [num_tokens, ...].
"""
from __future__ import annotations

import torch
from torch import nn

from engine.ops.attention_backends import paged_attention
from engine.config import EngineConfig
from engine.ops.kv_writer import write_kv
from engine.models.cpu_gemm import PackedLinear, fused_linear
from engine.models.fused_stack import FusedLayerStack
from engine.models.layers import Linear, RMSNorm, SiluMLP, StepContext, pack_linears
from engine.models.rotary import RotaryEmbedding, rope_parameters


class Attention(nn.Module):
    def __init__(self, config: EngineConfig, layer_index: int):
        super().__init__()
        mc = config.model
        hf = mc.hf_config
        arch = mc.architecture
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = mc.num_heads, mc.num_kv_heads, mc.head_dim
        layer_types, window = hf.get("layer_types") or [], hf.get("sliding_window")
        if (layer_index < len(layer_types) and layer_types[layer_index] == "sliding_attention"
                and window and window < config.max_model_len):
            raise ValueError(f"sliding_window={window} (layer {layer_index}) is not supported; "
                             f"set max_model_len <= {window}")
        if arch == "Qwen2MoeForCausalLM":
            bias = bool(hf.get("qkv_bias", True))
        else:
            bias = arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False))
        o_bias = bool(hf.get("attention_bias", False)) and not arch.startswith(("Qwen2", "Mixtral"))
        hidden = mc.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.qk_norm = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf.get("rms_norm_eps", 1e-6))
            self.k_norm = RMSNorm(self.head_dim, hf.get("rms_norm_eps", 1e-6))
        self.rotary = RotaryEmbedding(self.head_dim, config.max_model_len, rope_parameters(hf))
        self.scale = self.head_dim ** -0.5
        self.qkv: PackedLinear | None = None  # [hidden] -> [(Hq + 2 Hkv) * head_dim], see fuse()

    def fuse(self) -> None:
        """One q|k|v matmul instead of three."""
        self.qkv = fused_linear(self.q_proj, self.k_proj, self.v_proj)
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            proj.release()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.qkv is not None:
            kv_size = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv(hidden).split([self.num_heads * self.head_dim, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        write_kv(k, v, k_cache, v_cache, ctx.meta.slot_mapping, ctx.null_block_writes, guard=ctx.write_guard)
        out = paged_attention(q, k_cache, v_cache, ctx.meta, self.scale, ctx.attention)
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: EngineConfig, layer_index: int, mlp: nn.Module | None = None):
        super().__init__()
        hf = config.model.hf_config
        eps = hf.get("rms_norm_eps", 1e-6)
        self.self_attn = Attention(config, layer_index)
        if mlp is None:  # Llama's config may give the MLP biases (mlp_bias); Qwen's never has them
            if hf.get("hidden_act", "silu") != "silu":
                raise ValueError(f"hidden_act: only silu is supported, got {hf['hidden_act']!r}")
            mlp = SiluMLP(config.model.hidden_size, hf["intermediate_size"], bias=bool(hf.get("mlp_bias", False)))
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.model.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.model.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), ctx)
        normed, hidden = self.post_attention_layernorm.add_forward(attn, hidden)  # hidden += attn, then norm
        return hidden + self.mlp(normed)


class DecoderModel(nn.Module):
    """Embedding, a stack of layers and the final norm; `make_layer` picks each layer's kind."""

    def __init__(self, config: EngineConfig, make_layer):
        super().__init__()
        mc = config.model
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(mc.num_layers))
        self.norm = RMSNorm(mc.hidden_size, mc.get("rms_norm_eps", 1e-6))
        self.fused: FusedLayerStack | None = None  # the layers as one CPU op, see fuse_layers()

    def fuse_layers(self) -> None:
        """After packing: run the layers as one csrc op where they are all dense (fused_stack.py)."""
        if all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention and type(layer.mlp) is SiluMLP
               for layer in self.layers):
            self.fused = FusedLayerStack.build(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        fused = self.fused.run(positions, hidden, ctx) if self.fused is not None else None
        if fused is not None:
            hidden = fused
        else:
            for layer in self.layers:
                hidden = layer(positions, hidden, ctx)
        return self.norm(hidden)


class CausalLM(nn.Module):
    """`model.*` + `lm_head`, the shape every supported architecture shares."""

    def __init__(self, config: EngineConfig, make_layer=DecoderLayer):
        super().__init__()
        mc = config.model
        self.config = config
        self.model = DecoderModel(config, make_layer)
        self.lm_head = Linear(mc.hidden_size, mc.vocab_size, bias=False)
        if mc.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)  # [num_tokens, hidden]

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (transformers' name), where a forward hook sees every step's first activations."""
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_tokens, vocab]

    def prepare_for_inference(self) -> None:
        """After loading, on CPU: fuse q|k|v and gate|up and prepack every linear layer for
        oneDNN (cpu_gemm). The LM head is most of a small model's decode step; packed, it
        runs about twice as fast as F.linear. A tied LM head gets its own packed copy."""
        if self.lm_head.weight.device.type != "cpu":
            return
        pack_linears(self)
        if not self.config.enforce_eager:
            self.model.fuse_layers()

    def wants_weight(self, name: str) -> bool:
        """Whether this rank loads checkpoint tensor `name` (MoE ranks skip others' experts)."""
        return not (name == "lm_head.weight" and self.config.model.tie_word_embeddings)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        params = self._params()
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                             f"{self.config.model.architecture}")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)

    def expected_weights(self) -> set[str]:
        return {n for n in self.state_dict() if self.wants_weight(n)}

    def missing_weights(self, loaded: set[str]) -> set[str]:
        """Expected weights that the checkpoint names `loaded` did not fill."""
        return self.expected_weights() - loaded

    def _params(self) -> dict[str, torch.Tensor]:
        if not hasattr(self, "_param_cache"):
            self._param_cache = dict(self.named_parameters(remove_duplicate=False))
            self._param_cache.update(dict(self.named_buffers()))
        return self._param_cache
