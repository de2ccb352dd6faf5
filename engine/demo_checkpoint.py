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
import functools
import hashlib
import json
import os
import pathlib
import random
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = [
    "ARCHITECTURES",
    "DEMO_PRESETS",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "default_config",
    "build_config",
    "build_state_dict",
    "build_tokenizer_json",
    "write_demo_checkpoint",
    "write_preset",
]

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Ids 0..4, in this order (the BPE trainer puts special tokens first).
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(len(SPECIAL_TOKENS))
_N_BYTES = 256
MIN_VOCAB_SIZE = _N_BYTES + len(SPECIAL_TOKENS)

# ChatML-like, rendered by transformers' apply_chat_template and by plain jinja2 alike.
# `content` may be a string or an OpenAI-style list of parts (text parts are concatenated).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_COMMON_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round "
    "man year came show every good me give our under name very through just form sentence "
    "great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light kind "
    "off need house picture try us again animal point mother world near build self earth father "
    "model token request server cache block batch layer attention expert router value key query "
    "hello question answer please thank explain write code function return import class def "
    "data list string number print error file test true false null none let var const python"
).split()
_ONSETS = ("", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t",
           "v", "w", "y", "z", "ch", "sh", "th", "st", "tr", "pl", "gr", "br", "cr", "str",
           "qu", "sp", "fl", "bl", "cl", "wh", "pr", "dr")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "ee", "oo", "ou", "io",
           "y", "ie", "au")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "nt", "ll",
          "ss", "x", "th", "sh", "ed", "er", "ly", "ing", "tion", "ment", "ness")
_PUNCT = (".", ",", ".", ",", "?", "!", ":", ";", " -", "'s", ")", "\n")


def _synthetic_corpus(vocab_size: int) -> list[str]:
    """Deterministic English-like text, sized so BPE training reaches `vocab_size` quickly."""
    rng = random.Random(0x6B7673)  # fixed: the tokenizer depends on vocab_size only
    merges_wanted = max(0, vocab_size - MIN_VOCAB_SIZE)
    n_words = min(60_000, 200 + 2 * merges_wanted)
    seen = set(_COMMON_WORDS)
    lexicon = list(_COMMON_WORDS)
    while len(lexicon) < n_words:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))))
        if word and word not in seen:
            seen.add(word)
            lexicon.append(word)
    n_lines = min(2_500, 20 + merges_wanted // 12)
    lines = []
    for _ in range(n_lines):
        out = []
        for _ in range(48):
            # Zipf-ish: low indexes (common words first) are drawn far more often.
            word = lexicon[int(len(lexicon) * rng.random() ** 2.5)]
            r = rng.random()
            if r < 0.08:
                word = word.capitalize()
            elif r < 0.10:
                word = str(rng.randrange(0, 10_000))
            out.append(word)
            if rng.random() < 0.12:
                out[-1] += rng.choice(_PUNCT)
        lines.append(" ".join(out))
    return lines


def _pad_merges(tok_json: dict, vocab_size: int) -> None:
    """Append merges of existing tokens until the vocabulary has exactly `vocab_size` entries."""
    vocab: dict[str, int] = tok_json["model"]["vocab"]
    merges: list = tok_json["model"]["merges"]
    base = sorted((tid, tok) for tok, tid in vocab.items()
                  if tok not in SPECIAL_TOKENS and tid < len(SPECIAL_TOKENS) + _N_BYTES)
    base_tokens = [tok for _, tok in base]
    next_id = len(vocab)
    for a in base_tokens:
        for b in base_tokens:
            if next_id >= vocab_size:
                return
            merged = a + b
            if merged in vocab:
                continue
            vocab[merged] = next_id
            merges.append([a, b])
            next_id += 1
    if next_id < vocab_size:  # pragma: no cover - 65k byte pairs always suffice for our sizes
        raise ValueError(f"vocab_size {vocab_size} too large for the demo tokenizer")


@functools.lru_cache(maxsize=16)
def build_tokenizer_json(vocab_size: int, *, train: bool = True) -> str:
    """Serialized `tokenizer.json` for a byte-level BPE with exactly `vocab_size` tokens.

    Ids 0..4 are `SPECIAL_TOKENS`, then the 256 byte symbols, then merges learnt from a
    deterministic synthetic corpus (`train=False` skips training and only pads, for tests).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + "
                         f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_synthetic_corpus(vocab_size) if train else [], trainer)
    tok_json = json.loads(tok.to_str())
    _pad_merges(tok_json, vocab_size)
    tok = Tokenizer.from_str(json.dumps(tok_json))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN}:0 $A:0",
            pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, BOS_ID)]),
    ])
    # Make the specials "added tokens" so text containing them is not split by BPE.
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"built {tok.get_vocab_size(with_added_tokens=True)} tokens, "
                             f"wanted {vocab_size}")
    return tok.to_str(pretty=True)


def _tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(max_length),
        "padding_side": "left",
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "chat_template": CHAT_TEMPLATE,
    }


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Arch:
    model_type: str
    family: str            # "gqa" or "mla"
    moe: str | None        # None, "mixtral", "qwen2_moe", "qwen3_moe", "deepseek"
    defaults: dict
    derive_head_dim: bool = True  # head_dim follows hidden_size // num_attention_heads


_COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "use_cache": True,
}
_QWEN_NO_SLIDING = {"use_sliding_window": False, "sliding_window": None}
_MLA = {
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 2,
    "topk_group": 1,
    "attention_bias": False,
}

ARCHITECTURES: dict[str, _Arch] = {
    "LlamaForCausalLM": _Arch("llama", "gqa", None, {
        "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}),
    "Qwen2ForCausalLM": _Arch("qwen2", "gqa", None, dict(_QWEN_NO_SLIDING)),
    "Qwen3ForCausalLM": _Arch("qwen3", "gqa", None, {
        "head_dim": 32, "attention_bias": False, **_QWEN_NO_SLIDING}, derive_head_dim=False),
    "MixtralForCausalLM": _Arch("mixtral", "gqa", "mixtral", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None}),
    "Qwen2MoeForCausalLM": _Arch("qwen2_moe", "gqa", "qwen2_moe", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": False, "qkv_bias": True, "router_aux_loss_coef": 0.001,
        **_QWEN_NO_SLIDING}),
    "Qwen3MoeForCausalLM": _Arch("qwen3_moe", "gqa", "qwen3_moe", {
        "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "attention_bias": False, "router_aux_loss_coef": 0.001, **_QWEN_NO_SLIDING},
        derive_head_dim=False),
    "DeepseekV2ForCausalLM": _Arch("deepseek_v2", "mla", "deepseek", {
        **_MLA, "topk_method": "group_limited_greedy", "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.5, "mlp_bias": False}),
    "DeepseekV3ForCausalLM": _Arch("deepseek_v3", "mla", "deepseek", {
        **_MLA, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rope_interleave": True, "num_nextn_predict_layers": 0}),
}

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_config(architecture: str) -> dict:
    """The tiny default config.json dict for `architecture`, before overrides."""
    arch = _arch(architecture)
    return {**copy.deepcopy(_COMMON), **copy.deepcopy(arch.defaults)}


def _arch(architecture: str) -> _Arch:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"choose one of {sorted(ARCHITECTURES)}") from None


def _rope_parameters(cfg: dict, overrides: dict) -> dict:
    """Fold rope_theta / rope_scaling / rope_parameters overrides into one rope_parameters dict."""
    params: dict[str, Any] = {"rope_type": "default"}
    scaling = overrides.get("rope_parameters") or overrides.get("rope_scaling") or {}
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:  # legacy spelling
        scaling["rope_type"] = scaling.pop("type")
    params.update(scaling)
    params.setdefault("rope_theta", float(cfg["rope_theta"]))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    if params["rope_type"] != "default" and "factor" not in params:
        raise ValueError(f"rope_type {params['rope_type']!r} needs a 'factor'")
    if params["rope_type"] == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"llama3 rope scaling needs {key!r}")
    return params


def build_config(architecture: str = "LlamaForCausalLM", *, init_scale: float = 0.02,
                 dtype: str = "float32", **config_overrides) -> dict:
    """The full config.json dict (overrides applied, derived fields filled, validated)."""
    arch = _arch(architecture)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")
    overrides = copy.deepcopy(config_overrides)
    cfg = default_config(architecture)
    rope_keys = {"rope_scaling", "rope_parameters"}
    cfg.update({k: v for k, v in overrides.items() if k not in rope_keys})
    if "rope_parameters" in overrides and "rope_theta" in (overrides["rope_parameters"] or {}) \
            and "rope_theta" not in overrides:
        cfg["rope_theta"] = float(overrides["rope_parameters"]["rope_theta"])

    if arch.family == "mla":
        if "num_key_value_heads" not in overrides:  # MLA: one latent, every head reads it
            cfg["num_key_value_heads"] = cfg["num_attention_heads"]
        cfg.pop("head_dim", None)  # transformers derives it (= qk_rope_head_dim)
    elif arch.derive_head_dim and "head_dim" not in overrides:
        if cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ValueError("hidden_size must be divisible by num_attention_heads "
                             "(or pass head_dim explicitly)")
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg["vocab_size"] < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}")
    if arch.moe == "deepseek":
        n_exp, n_group = cfg["n_routed_experts"], cfg.get("n_group") or 1
        if n_exp % n_group:
            raise ValueError("n_routed_experts must be divisible by n_group")
        if cfg["num_experts_per_tok"] > n_exp:
            raise ValueError("num_experts_per_tok > n_routed_experts")
        if cfg.get("topk_method") == "noaux_tc" and n_exp // n_group < 2:
            raise ValueError("noaux_tc scores a group by its top-2 experts: "
                             "need >= 2 experts per group")
        if (cfg.get("moe_layer_freq") or 1) != 1:
            raise ValueError("moe_layer_freq != 1 is not supported by transformers' DeepSeek models")
        if architecture == "DeepseekV2ForCausalLM" and cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ValueError("transformers requires hidden_size % num_attention_heads == 0 for V2")
    if arch.model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        cfg.setdefault("max_window_layers", cfg["num_hidden_layers"])

    rope = _rope_parameters(cfg, overrides)
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_parameters"] = rope
    legacy = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else legacy

    cfg.update({
        "architectures": [architecture],
        "model_type": arch.model_type,
        "initializer_range": init_scale,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
        "torch_dtype": dtype,
        "dtype": dtype,
    })
    return dict(sorted(cfg.items()))


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------

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
    arch = _arch(architecture)
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
    target = _DTYPE_NAMES[dtype]
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
    _write_json(out / "tokenizer_config.json", _tokenizer_config(cfg["max_position_embeddings"]))
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
