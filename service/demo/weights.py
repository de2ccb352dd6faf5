"""The demo checkpoints' tensors: hub names and layouts per architecture, each tensor drawn from
its own generator seeded by (seed, name), so the same arguments give the same bytes."""
from __future__ import annotations

import hashlib

import torch
from service.demo.configs import arch_of, DTYPE_NAMES

# kind: "w" matrix normal(0, s), "b" bias normal(0, 5 s), "n" norm 1 + 0.1 normal,
#       "e" e_score_correction_bias normal(0, 1.5 s) stored float32.
_Spec = tuple  # (name, shape, kind)


def _is_moe_layer(cfg: dict, moe: str | None, i: int) -> bool:
    if moe is None:
        return False
    if moe == "mixtral":
        return True
    if moe in ("qwen2_moe", "qwen3_moe"):
        return (i not in (cfg.get("mlp_only_layers") or [])
                and cfg["num_experts"] > 0 and (i + 1) % cfg["decoder_sparse_step"] == 0)
    if moe == "deepseek":
        return i >= cfg["first_k_dense_replace"]
    raise AssertionError(moe)


def _mlp(prefix: str, hidden: int, inter: int, bias: bool = False) -> list[_Spec]:
    specs = [(f"{prefix}.gate_proj.weight", (inter, hidden), "w"),
             (f"{prefix}.up_proj.weight", (inter, hidden), "w"),
             (f"{prefix}.down_proj.weight", (hidden, inter), "w")]
    if bias:
        specs += [(f"{prefix}.gate_proj.bias", (inter,), "b"),
                  (f"{prefix}.up_proj.bias", (inter,), "b"),
                  (f"{prefix}.down_proj.bias", (hidden,), "b")]
    return specs


def _weight_specs(architecture: str, cfg: dict) -> list[_Spec]:
    arch = arch_of(architecture)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    specs: list[_Spec] = [("model.embed_tokens.weight", (vocab, h), "w")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [(f"{p}.input_layernorm.weight", (h,), "n"),
                  (f"{p}.post_attention_layernorm.weight", (h,), "n")]
        a = f"{p}.self_attn"
        if arch.family == "gqa":
            hd = cfg["head_dim"]
            specs += [(f"{a}.q_proj.weight", (nh * hd, h), "w"),
                      (f"{a}.k_proj.weight", (nkv * hd, h), "w"),
                      (f"{a}.v_proj.weight", (nkv * hd, h), "w"),
                      (f"{a}.o_proj.weight", (h, nh * hd), "w")]
            if arch.model_type == "qwen2":
                qkv_bias, o_bias = True, False
            elif arch.model_type == "qwen2_moe":
                qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
            elif arch.model_type == "mixtral":
                qkv_bias = o_bias = False
            else:
                qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            if qkv_bias:
                specs += [(f"{a}.q_proj.bias", (nh * hd,), "b"),
                          (f"{a}.k_proj.bias", (nkv * hd,), "b"),
                          (f"{a}.v_proj.bias", (nkv * hd,), "b")]
            if o_bias:
                specs += [(f"{a}.o_proj.bias", (h,), "b")]
            if arch.model_type in ("qwen3", "qwen3_moe"):
                specs += [(f"{a}.q_norm.weight", (hd,), "n"), (f"{a}.k_norm.weight", (hd,), "n")]
        else:  # MLA
            nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            qk, q_lora, kv_lora = nope + rope, cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
            bias = bool(cfg.get("attention_bias", False))
            if q_lora is None:
                specs += [(f"{a}.q_proj.weight", (nh * qk, h), "w")]
            else:
                specs += [(f"{a}.q_a_proj.weight", (q_lora, h), "w")]
                if bias:
                    specs += [(f"{a}.q_a_proj.bias", (q_lora,), "b")]
                specs += [(f"{a}.q_a_layernorm.weight", (q_lora,), "n"),
                          (f"{a}.q_b_proj.weight", (nh * qk, q_lora), "w")]
            specs += [(f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, h), "w")]
            if bias:
                specs += [(f"{a}.kv_a_proj_with_mqa.bias", (kv_lora + rope,), "b")]
            specs += [(f"{a}.kv_a_layernorm.weight", (kv_lora,), "n"),
                      (f"{a}.kv_b_proj.weight", (nh * (nope + vd), kv_lora), "w"),
                      (f"{a}.o_proj.weight", (h, nh * vd), "w")]
            if bias:
                specs += [(f"{a}.o_proj.bias", (h,), "b")]

        moe = arch.moe
        if not _is_moe_layer(cfg, moe, i):
            specs += _mlp(f"{p}.mlp", h, cfg["intermediate_size"], bool(cfg.get("mlp_bias")))
        elif moe == "mixtral":
            m, inter = f"{p}.block_sparse_moe", cfg["intermediate_size"]
            specs += [(f"{m}.gate.weight", (cfg["num_local_experts"], h), "w")]
            for e in range(cfg["num_local_experts"]):
                specs += [(f"{m}.experts.{e}.w1.weight", (inter, h), "w"),
                          (f"{m}.experts.{e}.w2.weight", (h, inter), "w"),
                          (f"{m}.experts.{e}.w3.weight", (inter, h), "w")]
        elif moe in ("qwen2_moe", "qwen3_moe"):
            m, inter = f"{p}.mlp", cfg["moe_intermediate_size"]
            specs += [(f"{m}.gate.weight", (cfg["num_experts"], h), "w")]
            for e in range(cfg["num_experts"]):
                specs += _mlp(f"{m}.experts.{e}", h, inter)
            if moe == "qwen2_moe":
                specs += _mlp(f"{m}.shared_expert", h, cfg["shared_expert_intermediate_size"])
                specs += [(f"{m}.shared_expert_gate.weight", (1, h), "w")]
        else:  # deepseek
            m, inter, n_exp = f"{p}.mlp", cfg["moe_intermediate_size"], cfg["n_routed_experts"]
            specs += [(f"{m}.gate.weight", (n_exp, h), "w")]
            if cfg.get("topk_method") == "noaux_tc":
                specs += [(f"{m}.gate.e_score_correction_bias", (n_exp,), "e")]
            for e in range(n_exp):
                specs += _mlp(f"{m}.experts.{e}", h, inter)
            if cfg.get("n_shared_experts"):
                specs += _mlp(f"{m}.shared_experts", h, inter * cfg["n_shared_experts"])
    specs += [("model.norm.weight", (h,), "n")]
    if not cfg.get("tie_word_embeddings", False):
        specs += [("lm_head.weight", (vocab, h), "w")]
    return specs


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"kvsentry-demo:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def build_state_dict(architecture: str, cfg: dict, *, init_scale: float = 0.02, seed: int = 0,
                     dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The on-disk tensors (hub names, hub layout), in a deterministic order."""
    target = DTYPE_NAMES[dtype]
    out: dict[str, torch.Tensor] = {}
    gen = torch.Generator(device="cpu")
    for name, shape, kind in _weight_specs(architecture, cfg):
        gen.manual_seed(_tensor_seed(seed, name))
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "w":
            t = (x * init_scale).to(target)
        elif kind == "b":
            t = (x * (5 * init_scale)).to(target)
        elif kind == "n":
            t = (1.0 + 0.1 * x).to(target)
        elif kind == "e":  # real DeepSeek-V3 checkpoints keep this buffer in float32
            t = x * (1.5 * init_scale)
        else:  # pragma: no cover
            raise AssertionError(kind)
        out[name] = t.contiguous()
    return out
