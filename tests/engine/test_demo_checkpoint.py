"""Tests for service/demo/checkpoint.py: checkpoints that transformers 5 loads exactly as written."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

from service.demo.checkpoint import DEMO_PRESETS, write_demo_checkpoint, write_preset
from service.demo.configs import ARCHITECTURES
from service.demo.tokenizer import BOS_TOKEN, EOS_TOKEN, SPECIAL_TOKENS, build_tokenizer_json

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL_ARCHS = sorted(ARCHITECTURES)
MOE_ARCHS = ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
             "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]
UTF8_TEXT = "héllo wörld 你好 🙂"
ASCII_TEXT = "Hello, world! The cache keeps 16 tokens per block."


# ---------------------------------------------------------------------------- helpers

def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, single-file or sharded."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(path / f)
        assert not set(part) & set(out), "a tensor is stored twice"
        out.update(part)
    return out


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")


def hub_to_transformers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What transformers 5 must hold in memory for the hub-layout tensors we wrote:
    Mixtral's block_sparse_moe -> mlp, w1/w3/w2 -> gate/up/down, and per-expert weights
    fused into experts.gate_up_proj [E, 2I, H] (gate rows first) and experts.down_proj [E, H, I]."""
    out, experts = {}, {}
    for name, t in sd.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m.group(3), m.group(3))
        experts.setdefault(m.group(1), {}).setdefault(proj, {})[int(m.group(2))] = t
    for prefix, projs in experts.items():
        n = len(projs["gate_proj"])
        assert sorted(projs["gate_proj"]) == list(range(n)) == sorted(projs["down_proj"])
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


def load_hf(path: Path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers loading problems: {problems}"
    return model.eval()


def assert_loaded_exactly(model, path: Path) -> None:
    """Every tensor we wrote is in the model with the same value, and nothing is left unset."""
    expected = hub_to_transformers(read_weights(path))
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    tied = bool(model.config.tie_word_embeddings)
    for name, want in expected.items():
        assert name in state, f"{name} written but transformers has no such tensor"
        got = state[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        # transformers may keep some tensors (router weights) in float32: compare the values.
        assert torch.equal(got.detach().to(torch.float32), want.to(torch.float32)), name
    for name, _ in model.named_parameters():
        if tied and name == "lm_head.weight":
            continue
        assert name in expected, f"transformers parameter {name} was not in the checkpoint"


def logits(model, ids=(0, 5, 77, 300, 41, 12, 400, 9)) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits


def file_hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.iterdir()) if p.is_file()}


# ---------------------------------------------------------------------------- architectures

@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_architecture_loads_in_transformers_exactly(tmp_path, arch):
    path = write_demo_checkpoint(tmp_path / "ckpt", arch)
    assert path == tmp_path / "ckpt"
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [arch]
    model = load_hf(path)
    assert type(model).__name__ == arch
    assert_loaded_exactly(model, path)
    out = logits(model)
    assert out.shape == (1, 8, config["vocab_size"]) == (1, 8, 512)
    assert torch.isfinite(out).all()
    assert out.std() > 0 and not torch.allclose(out[0, 0], out[0, -1])


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_default_shapes_are_tiny_and_non_trivial(arch):
    from service.demo.configs import build_config
    from service.demo.weights import build_state_dict
    cfg = build_config(arch)
    assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 512
    assert cfg["max_position_embeddings"] == 2048 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["rope_theta"] == 10000.0
    sd = build_state_dict(arch, cfg)
    norms = [t for n, t in sd.items() if n.endswith("norm.weight")]
    assert norms and all(not torch.allclose(t, torch.ones_like(t)) for t in norms)
    assert all((t - 1).abs().max() < 1.0 for t in norms)
    biases = [t for n, t in sd.items() if n.endswith(".bias")]
    assert all(t.abs().min() > 0 for t in biases)
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        assert {n.rsplit(".", 2)[-2] for n in sd if n.endswith(".bias")} == {"q_proj", "k_proj", "v_proj"}
    else:
        assert not biases
    emb = sd["model.embed_tokens.weight"]
    assert 0.015 < emb.std().item() < 0.025  # normal(0, 0.02)


def test_gqa_default_and_explicit_head_dim(tmp_path):
    llama = json.loads((write_demo_checkpoint(tmp_path / "l") / "config.json").read_text())
    assert (llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"]) == (4, 2, 16)
    sd = read_weights(write_demo_checkpoint(tmp_path / "q3", "Qwen3ForCausalLM", head_dim=24))
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 24, 64)
    assert sd["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 24, 64)
    assert sd["model.layers.0.self_attn.q_norm.weight"].shape == (24,)
    model = load_hf(tmp_path / "q3")
    assert_loaded_exactly(model, tmp_path / "q3")
    sd = read_weights(write_demo_checkpoint(tmp_path / "l2", hidden_size=128, num_attention_heads=8,
                                            num_key_value_heads=1))
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (16, 128)


def test_mixtral_and_qwen_moe_hub_layout(tmp_path):
    mix = read_weights(write_demo_checkpoint(tmp_path / "m", "MixtralForCausalLM"))
    assert mix["model.layers.1.block_sparse_moe.gate.weight"].shape == (4, 64)
    assert mix["model.layers.1.block_sparse_moe.experts.3.w1.weight"].shape == (128, 64)
    assert mix["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (64, 128)
    assert not [n for n in mix if ".mlp." in n]

    q2 = read_weights(write_demo_checkpoint(tmp_path / "q2", "Qwen2MoeForCausalLM",
                                            num_hidden_layers=3, mlp_only_layers=[1]))
    assert "model.layers.1.mlp.gate_proj.weight" in q2 and "model.layers.1.mlp.gate.weight" not in q2
    assert q2["model.layers.2.mlp.experts.0.gate_proj.weight"].shape == (32, 64)
    assert q2["model.layers.2.mlp.shared_expert.up_proj.weight"].shape == (64, 64)
    assert q2["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert_loaded_exactly(load_hf(tmp_path / "q2"), tmp_path / "q2")

    q3 = read_weights(write_demo_checkpoint(tmp_path / "q3", "Qwen3MoeForCausalLM", num_experts=6))
    assert q3["model.layers.0.mlp.gate.weight"].shape == (6, 64)
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in q3
    assert not [n for n in q3 if "shared" in n]


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_deepseek_mla_and_moe_layout(tmp_path, arch):
    path = write_demo_checkpoint(tmp_path / "ds", arch)
    cfg = json.loads((path / "config.json").read_text())
    sd = read_weights(path)
    v3 = arch == "DeepseekV3ForCausalLM"
    assert cfg["topk_method"] == ("noaux_tc" if v3 else "group_limited_greedy")
    assert cfg["scoring_func"] == ("sigmoid" if v3 else "softmax")
    assert cfg["first_k_dense_replace"] == 1 and cfg["num_key_value_heads"] == cfg["num_attention_heads"]
    a = "model.layers.0.self_attn"
    assert sd[f"{a}.q_a_proj.weight"].shape == (32, 64)
    assert sd[f"{a}.q_b_proj.weight"].shape == (4 * (16 + 8), 32)
    assert sd[f"{a}.kv_a_proj_with_mqa.weight"].shape == (32 + 8, 64)
    assert sd[f"{a}.kv_a_layernorm.weight"].shape == (32,)
    assert sd[f"{a}.kv_b_proj.weight"].shape == (4 * (16 + 16), 32)
    assert sd[f"{a}.o_proj.weight"].shape == (64, 4 * 16)
    # layer 0 dense, layer 1 MoE with 4 routed experts and 1 shared expert
    assert "model.layers.0.mlp.gate_proj.weight" in sd and "model.layers.0.mlp.gate.weight" not in sd
    assert sd["model.layers.1.mlp.gate.weight"].shape == (4, 64)
    assert sd["model.layers.1.mlp.experts.3.up_proj.weight"].shape == (32, 64)
    assert sd["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (64, 32)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    if v3:
        assert sd[bias].dtype == torch.float32 and sd[bias].abs().min() > 0
        assert cfg["rope_interleave"] is True
    else:
        assert bias not in sd


def test_deepseek_v3_correction_bias_changes_routing(tmp_path):
    model = load_hf(write_preset(tmp_path / "v3", "tiny-deepseek-v3"))
    before = logits(model, ids=range(5, 69))
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    after = logits(model, ids=range(5, 69))
    assert not torch.allclose(before, after, atol=1e-6), "e_score_correction_bias has no effect"


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_deepseek_without_q_lora(tmp_path, arch):
    path = write_demo_checkpoint(tmp_path / "ds", arch, q_lora_rank=None)
    sd = read_weights(path)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 24, 64)
    assert not [n for n in sd if "q_a_proj" in n or "q_b_proj" in n or "q_a_layernorm" in n]
    assert json.loads((path / "config.json").read_text())["q_lora_rank"] is None
    model = load_hf(path)
    assert_loaded_exactly(model, path)
    assert torch.isfinite(logits(model)).all()


def test_tied_embeddings(tmp_path):
    path = write_demo_checkpoint(tmp_path / "t", "Qwen2ForCausalLM", tie_word_embeddings=True)
    assert "lm_head.weight" not in read_weights(path)
    model = load_hf(path)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("scaling,expected_first", [
    ({"rope_type": "linear", "factor": 2.0}, 0.5),
    ({"type": "linear", "factor": 4.0}, 0.25),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 512}, 1.0),
])
def test_rope_scaling_written_both_ways(tmp_path, scaling, expected_first):
    path = write_demo_checkpoint(tmp_path / "r", rope_scaling=scaling)
    cfg = json.loads((path / "config.json").read_text())
    rope_type = scaling.get("rope_type", scaling.get("type"))
    assert cfg["rope_parameters"]["rope_type"] == rope_type == cfg["rope_scaling"]["rope_type"]
    assert cfg["rope_parameters"]["factor"] == scaling["factor"]
    assert cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"] == 10000.0
    model = load_hf(path)
    assert model.config.rope_parameters["rope_type"] == rope_type
    inv_freq = model.model.rotary_emb.inv_freq
    default = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert inv_freq[0].item() == pytest.approx(expected_first)
    if rope_type == "linear":
        torch.testing.assert_close(inv_freq, default / scaling["factor"])
    else:  # llama3: the high-frequency end is untouched, the low-frequency end divided by factor
        assert inv_freq[-1].item() == pytest.approx(default[-1].item() / 8.0, rel=1e-5)


def test_default_rope_has_no_scaling(tmp_path):
    cfg = json.loads((write_demo_checkpoint(tmp_path / "r", rope_theta=500000.0) / "config.json").read_text())
    assert cfg["rope_scaling"] is None
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}


# ---------------------------------------------------------------------------- dtype, determinism, shards

@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_bfloat16(tmp_path, arch):
    path = write_demo_checkpoint(tmp_path / "bf", arch, dtype="bfloat16")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    with safe_open(path / "model.safetensors", "pt") as f:
        for name in f.keys():
            want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            assert f.get_tensor(name).dtype == want, name
    model = load_hf(path)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert_loaded_exactly(model, path)
    out = logits(model)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    f32 = read_weights(write_demo_checkpoint(tmp_path / "f32", arch))
    # bf16 weights are the float32 weights rounded
    torch.testing.assert_close(read_weights(path)["lm_head.weight"],
                               f32["lm_head.weight"].to(torch.bfloat16), rtol=0, atol=0)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = write_demo_checkpoint(tmp_path / "a", "DeepseekV3ForCausalLM", seed=3)
    b = write_demo_checkpoint(tmp_path / "b", "DeepseekV3ForCausalLM", seed=3)
    c = write_demo_checkpoint(tmp_path / "c", "DeepseekV3ForCausalLM", seed=4)
    assert file_hashes(a) == file_hashes(b)
    ha, hc = file_hashes(a), file_hashes(c)
    assert ha["model.safetensors"] != hc["model.safetensors"]
    assert ha["tokenizer.json"] == hc["tokenizer.json"] and ha["config.json"] == hc["config.json"]
    wa, wc = read_weights(a), read_weights(c)
    assert all(not torch.equal(wa[n], wc[n]) for n in wa)


def test_bytes_identical_across_processes(tmp_path):
    here = write_demo_checkpoint(tmp_path / "here", "Qwen2MoeForCausalLM", seed=11, vocab_size=700)
    code = ("import sys; from service.demo.checkpoint import write_demo_checkpoint; "
            "write_demo_checkpoint(sys.argv[1], 'Qwen2MoeForCausalLM', seed=11, vocab_size=700)")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True, env=env,
                   cwd=REPO_ROOT, timeout=120)
    assert file_hashes(here) == file_hashes(tmp_path / "there")


def test_sharded_checkpoint(tmp_path):
    single = write_demo_checkpoint(tmp_path / "one", "MixtralForCausalLM")
    path = write_demo_checkpoint(tmp_path / "three", "MixtralForCausalLM", shards=3)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    for f in files:
        with safe_open(path / f, "pt") as h:
            keys = list(h.keys())
        assert keys and all(index["weight_map"][k] == f for k in keys)
    whole = read_weights(single)
    assert set(index["weight_map"]) == set(whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    sharded = read_weights(path)
    assert all(torch.equal(sharded[n], whole[n]) for n in whole)
    model = load_hf(path)
    assert_loaded_exactly(model, path)
    torch.testing.assert_close(logits(model), logits(load_hf(single)), rtol=0, atol=0)
    # Rewriting with one shard removes the old shards and index.
    write_demo_checkpoint(path, "MixtralForCausalLM")
    assert sorted(p.name for p in path.glob("model*")) == ["model.safetensors"]


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError):
        write_demo_checkpoint(tmp_path / "x", "GPT2LMHeadModel")
    with pytest.raises(ValueError):
        write_demo_checkpoint(tmp_path / "x", vocab_size=100)
    with pytest.raises(ValueError):
        write_demo_checkpoint(tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError):
        write_demo_checkpoint(tmp_path / "x", shards=0)
    with pytest.raises(ValueError):
        write_demo_checkpoint(tmp_path / "x", shards=10_000)
    with pytest.raises(ValueError):
        write_demo_checkpoint(tmp_path / "x", num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError):
        write_demo_checkpoint(tmp_path / "x", "DeepseekV3ForCausalLM", n_routed_experts=6, n_group=4)
    with pytest.raises(ValueError):
        write_demo_checkpoint(tmp_path / "x", rope_scaling={"rope_type": "linear"})
    with pytest.raises(ValueError):
        write_preset(tmp_path / "x", "no-such-preset")


# ---------------------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("vocab_size", [261, 300, 512, 1000])
def test_tokenizer_vocab_is_exactly_config_vocab(tmp_path, vocab_size):
    path = write_demo_checkpoint(tmp_path / "t", vocab_size=vocab_size)
    cfg = json.loads((path / "config.json").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert cfg["vocab_size"] == vocab_size
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    assert sorted(tok.get_vocab(with_added_tokens=True).values()) == list(range(vocab_size))
    for i in range(vocab_size):
        assert tok.id_to_token(i) is not None
        tok.decode([i], skip_special_tokens=False)
    for text in (ASCII_TEXT, UTF8_TEXT, "  two  spaces\nand\ttabs "):
        ids = tok.encode(text).ids
        assert ids[0] == 0 and max(ids) < vocab_size
        assert tok.decode(ids) == text
    assert len(AutoTokenizer.from_pretrained(path)) == vocab_size


def test_padding_path_when_training_yields_too_few_merges():
    tok = Tokenizer.from_str(build_tokenizer_json(2000, train=False))
    assert tok.get_vocab_size(with_added_tokens=True) == 2000
    assert tok.decode(tok.encode(UTF8_TEXT).ids) == UTF8_TEXT
    trained = Tokenizer.from_str(build_tokenizer_json(2000))
    # training learns English-like merges: far fewer tokens than bytes for ordinary text
    assert len(trained.encode(ASCII_TEXT).ids) < 0.6 * len(ASCII_TEXT.encode())


def test_tokenizer_deterministic_fresh_build():
    fresh = build_tokenizer_json.__wrapped__
    assert fresh(3000) == fresh(3000)


def test_hf_tokenizer_round_trip_specials_and_ids(tmp_path):
    path = write_preset(tmp_path / "v3", "tiny-deepseek-v3")
    tok = AutoTokenizer.from_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tcfg["model_max_length"] == cfg["max_position_embeddings"]
    assert (tok.bos_token, tok.eos_token) == (BOS_TOKEN, EOS_TOKEN)
    assert tok.bos_token_id == cfg["bos_token_id"] == gen["bos_token_id"] == 0
    assert tok.eos_token_id == cfg["eos_token_id"] == 1
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert gen["eos_token_id"] == [1, im_end]
    assert tok.pad_token_id == gen["pad_token_id"] != tok.eos_token_id
    for text in (ASCII_TEXT, UTF8_TEXT):
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids) == BOS_TOKEN + text
    # special tokens in text are single tokens, not split by BPE
    ids = tok("<|im_start|>user<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == im_end
    assert len(set(tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)))) == len(SPECIAL_TOKENS)


def test_chat_template(tmp_path):
    tok = AutoTokenizer.from_pretrained(write_preset(tmp_path / "l", "tiny-llama"))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                             {"type": "text", "text": "there 🙂"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi there 🙂<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text.startswith(no_prompt) and not no_prompt.endswith("assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2
    assert tok.decode(ids) == text


# ---------------------------------------------------------------------------- presets

def test_preset_table():
    assert set(DEMO_PRESETS) == {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral",
                                 "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-deepseek-v2",
                                 "tiny-deepseek-v3", "bench-llama"}
    assert {p["architecture"] for p in DEMO_PRESETS.values()} == set(ARCHITECTURES)


@pytest.mark.parametrize("name", sorted(DEMO_PRESETS))
def test_preset_loads(tmp_path, name):
    path = write_preset(tmp_path / name, name)
    cfg = json.loads((path / "config.json").read_text())
    model = load_hf(path)
    assert_loaded_exactly(model, path)
    out = logits(model)
    assert out.shape[-1] == cfg["vocab_size"] and torch.isfinite(out).all()
    assert Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size() == cfg["vocab_size"]
    if name == "tiny-deepseek-v3":
        assert (cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["n_shared_experts"]) == (3, 8, 1)
        assert (cfg["first_k_dense_replace"], cfg["n_group"], cfg["topk_group"]) == (1, 2, 1)
        assert cfg["vocab_size"] == 512 and cfg["topk_method"] == "noaux_tc"
    if name == "bench-llama":
        assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                cfg["num_key_value_heads"], cfg["vocab_size"]) == (256, 4, 8, 4, 32000)


def test_preset_overrides_win(tmp_path):
    path = write_preset(tmp_path / "p", "tiny-deepseek-v3", num_hidden_layers=2, seed=5)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 128
    again = write_demo_checkpoint(tmp_path / "q", **{**DEMO_PRESETS["tiny-deepseek-v3"],
                                                     "num_hidden_layers": 2, "seed": 5})
    assert file_hashes(path) == file_hashes(again)
