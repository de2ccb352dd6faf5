"""Mixtral: Llama attention + a sparse MoE block (softmax top-k, renormalised), no shared expert.

Hub checkpoints name the block `block_sparse_moe` and the expert projections w1 (gate),
w3 (up) and w2 (down); the modules here carry the same names. transformers 5's own layout
(`mlp`, fused experts) is mapped onto them by MoECausalLM.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import EngineConfig
from engine.models.expert_parallel import ExpertParallel
from engine.models.layers import StepContext
from engine.models.llama import DecoderLayer
from engine.models.moe import MoECausalLM, SoftmaxTopKRouter, SparseMoeBlock, StackedExperts


class MixtralDecoderLayer(DecoderLayer):
    def __init__(self, config: EngineConfig, layer_index: int, ep: ExpertParallel):
        super().__init__(config, layer_index, mlp=nn.Identity())
        del self.mlp  # the MoE block lives under its checkpoint name instead
        mc, hf = config.model, config.model.hf_config
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only silu is supported, got {hf['hidden_act']!r}")
        window = hf.get("sliding_window")
        if window is not None and window < config.max_model_len:
            raise ValueError(f"sliding_window={window} is not supported; "
                             f"set max_model_len <= {window}")
        gate = SoftmaxTopKRouter(mc.hidden_size, mc.num_experts, hf["num_experts_per_tok"],
                                 norm_topk_prob=True, round_to_model_dtype=False)
        experts = StackedExperts(mc.hidden_size, hf["intermediate_size"], ep.expert_range(mc.num_experts),
                                 names=("w1", "w3", "w2"))
        self.block_sparse_moe = SparseMoeBlock(gate, experts, ep)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), ctx)
        return hidden + self.block_sparse_moe(self.post_attention_layernorm(hidden))


def mixtral_for_causal_lm(config: EngineConfig) -> MoECausalLM:
    # transformers 5 names the block `mlp` in memory and in checkpoints saved in that layout.
    return MoECausalLM(config, MixtralDecoderLayer, aliases={".mlp.": ".block_sparse_moe."})
