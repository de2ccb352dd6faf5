"""Write tiny, deterministic Hugging Face format checkpoints for tests, demos and benchmarks.

No model can be downloaded where kvsentry is developed and tested, so every model the engine
serves in tests, in the demo deployment and in the CPU benchmark is *written* by this module.
A checkpoint directory holds exactly what a real Hugging Face hub repository holds, and both
``transformers`` (``AutoModelForCausalLM`` / ``AutoTokenizer``, offline) and our engine load it:

- ``config.json``: the architecture's usual keys, RoPE written both ways (``rope_parameters``
  as transformers 5 writes it, and the legacy ``rope_theta`` / ``rope_scaling`` pair);
- ``model.safetensors``, or ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``
  when ``shards > 1``, in the classic hub layout: one tensor per expert
  (``mlp.experts.{e}.gate_proj``, or Mixtral's ``block_sparse_moe.experts.{e}.w1``), never the
  fused 3-D expert tensors transformers 5 builds in memory;
- ``tokenizer.json``: byte-level BPE whose vocabulary size equals ``config.vocab_size`` exactly,
  so every id the model can emit decodes; the BOS token is added by the post-processor;
- ``tokenizer_config.json`` with a ChatML-like Jinja ``chat_template``;
- ``generation_config.json``.

Weights are seeded ``normal(0, init_scale)`` matrices, RMSNorm weights ``1 + 0.1 * normal`` and
non-zero biases, each tensor drawn from its own generator seeded by ``(seed, tensor name)``:
the same arguments give the same bytes, and changing one tensor's shape leaves the others alone.

Only ``torch``, ``safetensors`` and ``tokenizers`` are needed to *write*; ``transformers`` is not.
"""
from __future__ import annotations

import copy
import json
import os
import pathlib
from typing import Any

from safetensors.torch import save_file
from service.demo.configs import build_config
from service.demo.tokenizer import BOS_ID, EOS_ID, IM_END_ID, PAD_ID, build_tokenizer_json, tokenizer_config
from service.demo.weights import build_state_dict

def _shard_plan(names: list[str], sizes: dict[str, int], shards: int) -> list[list[str]]:
    if shards < 1:
        raise ValueError("shards must be >= 1")
    if shards > len(names):
        raise ValueError(f"shards={shards} but the checkpoint has only {len(names)} tensors")
    total = sum(sizes.values())
    plan: list[list[str]] = [[] for _ in range(shards)]
    acc, k = 0, 0
    for idx, name in enumerate(names):
        remaining_names = len(names) - idx
        remaining_shards = shards - k - 1
        # Move on once this shard has its share, keeping at least one tensor per later shard.
        if plan[k] and k < shards - 1 and (acc >= total * (k + 1) / shards
                                           or remaining_names <= remaining_shards):
            k += 1
        plan[k].append(name)
        acc += sizes[name]
    return plan


def _write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_checkpoint(path: str | os.PathLike, architecture: str = "LlamaForCausalLM", *,
                          init_scale: float = 0.02, seed: int = 0, dtype: str = "float32",
                          shards: int = 1, **config_overrides) -> pathlib.Path:
    """Write a tiny deterministic HF checkpoint of `architecture` into directory `path`.

    `config_overrides` are config.json keys (hidden_size, num_hidden_layers, vocab_size,
    num_experts, q_lora_rank=None, rope_scaling={"rope_type": "linear", "factor": 2.0}, ...).
    Returns the directory as a `pathlib.Path`.
    """
    cfg = build_config(architecture, init_scale=init_scale, dtype=dtype, **config_overrides)
    tensors = build_state_dict(architecture, cfg, init_scale=init_scale, seed=seed, dtype=dtype)
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # Remove weights of an earlier write with another shard count, so loaders see one layout.
    for stale in list(out.glob("model-*-of-*.safetensors")) + [
            out / "model.safetensors", out / "model.safetensors.index.json"]:
        if stale.exists():
            stale.unlink()

    meta = {"format": "pt"}
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
    else:
        sizes = {n: tensors[n].numel() * tensors[n].element_size() for n in names}
        plan = _shard_plan(names, sizes, shards)
        weight_map = {}
        for k, group in enumerate(plan):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in group}, str(out / fname), metadata=meta)
            weight_map.update({n: fname for n in group})
        _write_json(out / "model.safetensors.index.json", {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": dict(sorted(weight_map.items())),
        })

    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {
        "_from_model_config": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, IM_END_ID],
        "pad_token_id": PAD_ID,
    })
    (out / "tokenizer.json").write_text(build_tokenizer_json(int(cfg["vocab_size"])) + "\n",
                                        encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(cfg["max_position_embeddings"]))
    return out


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

DEMO_PRESETS: dict[str, dict] = {
    "tiny-llama": {"architecture": "LlamaForCausalLM"},
    "tiny-qwen2": {"architecture": "Qwen2ForCausalLM"},
    "tiny-qwen3": {"architecture": "Qwen3ForCausalLM"},
    "tiny-mixtral": {"architecture": "MixtralForCausalLM"},
    "tiny-qwen2-moe": {"architecture": "Qwen2MoeForCausalLM", "num_hidden_layers": 3,
                       "mlp_only_layers": [0]},
    "tiny-qwen3-moe": {"architecture": "Qwen3MoeForCausalLM", "num_experts": 8},
    "tiny-deepseek-v2": {"architecture": "DeepseekV2ForCausalLM", "num_hidden_layers": 3,
                         "n_routed_experts": 8, "n_group": 2, "topk_group": 1},
    # The default served demo: small DeepSeek-V3 MoE with MLA.
    "tiny-deepseek-v3": {
        "architecture": "DeepseekV3ForCausalLM", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 3, "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
        "vocab_size": 512},
    "bench-llama": {
        "architecture": "LlamaForCausalLM", "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "vocab_size": 32000, "max_position_embeddings": 4096},
}


def write_preset(path: str | os.PathLike, name: str, **overrides) -> pathlib.Path:
    """Write preset `name` from DEMO_PRESETS into `path`; `overrides` win over the preset."""
    if name not in DEMO_PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(DEMO_PRESETS)}")
    kwargs = {**copy.deepcopy(DEMO_PRESETS[name]), **overrides}
    return write_demo_checkpoint(path, **kwargs)
