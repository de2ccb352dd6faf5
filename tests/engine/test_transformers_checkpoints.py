"""Checkpoints written by transformers itself load and generate exactly as transformers does.

Every other equivalence test loads what service/demo/checkpoint.py writes; here the
installed `transformers` builds each supported architecture from its own config class
(with the fields that change the model's structure), `save_pretrained`s it, and the engine
must load that directory and produce transformers' greedy tokens, at DP=1 and, for MoE
models, at DP=2 with the experts split over the two ranks.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.dp_helpers import free_port_block, make_prompts

VOCAB = 512
NEW_TOKENS = 12
PROMPT_LENGTHS = (1, 6, 19, 40)
INIT_STD = 0.2
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(max_model_len=128, num_gpu_blocks=64)

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TINY_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# transformers' MLA repeats keys per num_key_value_heads, so (as in DeepSeek's configs) it equals the heads.
TINY_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                n_routed_experts=4, **TINY_MOE)

LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
DEEPSEEK_YARN = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


# transformers 5 saves the hub layout (one tensor per expert) unless told to keep its own.
FUSED = dict(save_original_format=False)  # [num_experts, ...] expert tensors, Mixtral's block as `mlp`
SHARDED = dict(max_shard_size="100KB")    # model-0000k-of-0000n.safetensors + index


@dataclass(frozen=True)
class Case:
    model_class: str  # a transformers class; its config class is `config_class` on it
    config: dict = field(default_factory=dict)
    save: dict = field(default_factory=dict)  # save_pretrained arguments
    save_dtype: torch.dtype | None = None     # cast before saving (the reference runs the cast weights in float32)

    @property
    def is_moe(self) -> bool:
        return any(key in self.config for key in ("num_experts", "num_local_experts", "n_routed_experts"))


CASES = {
    "llama": Case("LlamaForCausalLM"),
    "llama-tied-bias-head-dim-24": Case("LlamaForCausalLM", dict(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, head_dim=24)),
    "llama-rope-linear": Case("LlamaForCausalLM", dict(rope_parameters=LINEAR)),
    "llama-rope-llama3": Case("LlamaForCausalLM", dict(rope_parameters=LLAMA3)),
    "llama-rope-yarn": Case("LlamaForCausalLM", dict(rope_parameters=YARN)),
    "llama-bfloat16-sharded": Case("LlamaForCausalLM", save=SHARDED, save_dtype=torch.bfloat16),
    "qwen2": Case("Qwen2ForCausalLM"),
    "qwen2-tied-rope-yarn": Case("Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_parameters=YARN)),
    "qwen3-tied-bias-head-dim-32": Case("Qwen3ForCausalLM", dict(
        tie_word_embeddings=True, attention_bias=True, head_dim=32)),
    "qwen3-rope-linear": Case("Qwen3ForCausalLM", dict(head_dim=16, rope_parameters=LINEAR)),
    "mixtral": Case("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-tied-head-dim-24-rope-linear": Case("MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True, head_dim=24,
        rope_parameters=LINEAR)),
    "mixtral-fused": Case("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), save=FUSED),
    "qwen2-moe-mlp-only-1": Case("Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=4, shared_expert_intermediate_size=48, mlp_only_layers=[1],
        **TINY_MOE)),
    "qwen2-moe-sparse-step-2-tied": Case("Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=4, shared_expert_intermediate_size=48, decoder_sparse_step=2,
        qkv_bias=False, norm_topk_prob=True, tie_word_embeddings=True, **TINY_MOE)),
    "qwen3-moe-mlp-only-0": Case("Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=4, mlp_only_layers=[0], head_dim=16, **TINY_MOE)),
    "qwen3-moe-mlp-only-0-fused-sharded": Case("Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=4, mlp_only_layers=[0], head_dim=16, **TINY_MOE),
        save={**FUSED, **SHARDED}),
    "qwen3-moe-sparse-step-2-bias-head-dim-32-llama3": Case("Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=4, decoder_sparse_step=2, attention_bias=True, head_dim=32,
        norm_topk_prob=True, rope_parameters=LLAMA3, **TINY_MOE)),
    "deepseek-v2-group-limited-q-lora": Case("DeepseekV2ForCausalLM", dict(
        num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1, n_group=2, topk_group=1,
        topk_method="group_limited_greedy", n_shared_experts=1, **TINY_MLA)),
    "deepseek-v2-greedy-no-q-lora-yarn-tied": Case("DeepseekV2ForCausalLM", dict(
        q_lora_rank=None, first_k_dense_replace=0, topk_method="greedy", n_shared_experts=2,
        tie_word_embeddings=True, rope_parameters=DEEPSEEK_YARN, **TINY_MLA)),
    "deepseek-v3-q-lora-groups": Case("DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1, n_group=2, topk_group=1, **TINY_MLA)),
    "deepseek-v3-q-lora-groups-fused-bfloat16": Case("DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1, n_group=2, topk_group=1, **TINY_MLA),
        save=FUSED, save_dtype=torch.bfloat16),
    "deepseek-v3-no-q-lora-neox-yarn-bias": Case("DeepseekV3ForCausalLM", dict(
        q_lora_rank=None, first_k_dense_replace=0, n_group=1, topk_group=1, rope_interleave=False,
        attention_bias=True, rope_parameters=DEEPSEEK_YARN, **TINY_MLA)),
}
DP2_CASES = ["qwen3-moe-mlp-only-0", "deepseek-v3-q-lora-groups-fused-bfloat16"]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every tensor the checkpoint holds: normal(0, INIT_STD) (so greedy choices are decisive,
    not near-ties), norm weights 1 + 0.1 * normal, biases non-zero too."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.1 * noise)
            else:
                tensor.copy_(INIT_STD * noise)


def write_checkpoint(case: Case, path: Path, seed: int = 0):
    """transformers builds and saves the model; returns it (in float32, eval mode)."""
    import transformers
    model_class = getattr(transformers, case.model_class)
    config = model_class.config_class(**{**TINY, **case.config})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomize(model, seed)
    if case.save_dtype is not None:
        model.to(case.save_dtype)
    model.save_pretrained(path, **case.save)
    return model.float()


def saved_names(path: Path) -> set[str]:
    from safetensors import safe_open
    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def write_tokenizer(path: Path) -> Path:
    """A word-level tokenizer of VOCAB tokens: the engine's frontend wants one; prompts are ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    with torch.inference_mode():
        return [model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
                for prompt in prompts]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("word-level-tokenizer"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """saved(case) -> (checkpoint dir, prompts, transformers' greedy tokens), once per case."""
    made: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}

    def get(name: str):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            model = write_checkpoint(CASES[name], path)
            prompts = make_prompts(VOCAB, PROMPT_LENGTHS, seed=len(made))
            made[name] = (path, prompts, hf_greedy(model, prompts))
        return made[name]

    return get


def test_matrix_covers_every_supported_architecture():
    from engine.config import SUPPORTED_ARCHITECTURES
    assert {case.model_class for case in CASES.values()} == set(SUPPORTED_ARCHITECTURES)
    assert all(CASES[name].is_moe for name in DP2_CASES)


@pytest.mark.parametrize("name", CASES)
def test_saved_checkpoint_is_token_identical_at_dp1(name, saved, tokenizer_dir):
    path, prompts, expected = saved(name)
    case = CASES[name]
    assert json.loads((path / "config.json").read_text())["architectures"] == [case.model_class]
    fused = {n for n in saved_names(path) if n.endswith(".experts.gate_up_proj")}
    assert bool(fused) == ("save_original_format" in case.save)
    assert (path / "model.safetensors.index.json").is_file() == ("max_shard_size" in case.save)
    with LLM(str(path), tokenizer=str(tokenizer_dir), **{"dtype": "float32", **ENGINE_ARGS}) as llm:
        outputs = llm.generate(prompts, GREEDY)
    for prompt, output, reference in zip(prompts, outputs, expected):
        assert output.outputs[0].token_ids == reference, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", DP2_CASES)
def test_saved_moe_checkpoint_is_token_identical_at_dp2(name, saved, tokenizer_dir):
    """DP=2 splits the experts over two rank processes; each prompt is pinned to a rank so
    both serve, and the other rank runs dummy batches to keep the collectives in step."""
    path, prompts, expected = saved(name)
    with LLM(str(path), tokenizer=str(tokenizer_dir), data_parallel_size=2,
             data_parallel_rpc_port=free_port_block(3), **{"dtype": "float32", **ENGINE_ARGS}) as llm:
        outputs = llm.generate(prompts, GREEDY, rank_of=[i % 2 for i in range(len(prompts))])
    for prompt, output, reference in zip(prompts, outputs, expected):
        assert output.outputs[0].token_ids == reference, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("model_class, config, error", [
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1), "sliding_window=32"),
    ("LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act"),
])
def test_fields_the_engine_does_not_implement_are_refused(model_class, config, error, tmp_path, tokenizer_dir):
    """Not served wrong in silence: a sliding window shorter than max_model_len, a non-SiLU MLP."""
    write_checkpoint(Case(model_class, config), tmp_path)
    with pytest.raises(ValueError, match=error):
        LLM(str(tmp_path), tokenizer=str(tokenizer_dir), **{"dtype": "float32", **ENGINE_ARGS})
