"""MoE and MLA models against transformers, through the paged cache.

Each case writes a tiny checkpoint (hub layout: one tensor per expert), runs
prefill + teacher-forced decode through PagedRunner, and compares every
position's logits with transformers' logits for the whole sequence.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.demo.checkpoint import write_demo_checkpoint
from engine.worker.loader import load_model
from engine.models.deepseek import MLAAttention
from engine.models.moe import DeepseekV2Router, DeepseekV3Router, StackedExperts
from tests.engine.forward_harness import PagedRunner, engine_config, hf_logits, random_tokens

ATOL = 1e-4
# Batched vs one-at-a-time: float32 GEMMs round differently for different row counts
# (~1e-6 relative on logits of magnitude ~10), so "the same" means this close.
BATCH_ATOL = 5e-5
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
         "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}

CASES = {
    "mixtral": ("MixtralForCausalLM", {}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", {"num_hidden_layers": 4, "mlp_only_layers": [2]}),
    "qwen2-moe-sparse-step-2": ("Qwen2MoeForCausalLM", {
        "num_hidden_layers": 4, "decoder_sparse_step": 2, "qkv_bias": False, "norm_topk_prob": True}),
    "qwen3-moe-attention-bias": ("Qwen3MoeForCausalLM", {"num_experts": 8, "attention_bias": True}),
    "deepseek-v2-group-limited-q-lora": ("DeepseekV2ForCausalLM", {
        "num_hidden_layers": 3, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
        "topk_method": "group_limited_greedy"}),
    "deepseek-v2-greedy-no-q-lora-yarn": ("DeepseekV2ForCausalLM", {
        "q_lora_rank": None, "topk_method": "greedy", "rope_scaling": _YARN}),
    "deepseek-v3-noaux-q-lora": ("DeepseekV3ForCausalLM", {
        "num_hidden_layers": 3, "n_routed_experts": 8, "n_group": 4, "topk_group": 2}),
    "deepseek-v3-no-q-lora-neox-yarn": ("DeepseekV3ForCausalLM", {
        "q_lora_rank": None, "rope_interleave": False, "rope_scaling": _YARN}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(case: str):
        if case not in made:
            arch, overrides = CASES[case]
            made[case] = write_demo_checkpoint(tmp_path_factory.mktemp(case), arch,
                                               init_scale=0.3, seed=7, **overrides)
        return made[case]
    return get


@pytest.mark.parametrize("case", CASES)
def test_prefill_and_decode_match_transformers(case, checkpoints):
    path = checkpoints(case)
    runner = PagedRunner(engine_config(path))
    vocab = runner.config.model.vocab_size
    for prompt_len in (1, 7, 33):
        tokens = random_tokens(prompt_len + 4, vocab, seed=prompt_len)
        expected = hf_logits(path, tokens)
        got = runner.run_sequence(f"req-{prompt_len}", tokens, prompt_len)
        assert (got - expected).abs().max().item() < ATOL, f"prompt of {prompt_len}"
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert runner.null_block_is_zero() and runner.null_block_writes.item() == 0


@pytest.mark.parametrize("case", CASES)
def test_batched_padded_decode_matches_unbatched(case, checkpoints):
    path = checkpoints(case)
    config = engine_config(path)
    model = load_model(config)
    vocab = config.model.vocab_size
    seqs = {"a": random_tokens(5 + 3, vocab, seed=11), "b": random_tokens(11 + 3, vocab, seed=12)}
    prompt = {"a": 5, "b": 11}

    alone = {key: PagedRunner(config, model).run_sequence(key, toks, prompt[key]) for key, toks in seqs.items()}

    batched = PagedRunner(config, model)
    logits = {key: [batched.step({key: toks[:prompt[key]]}, pad_to=16)[key]] for key, toks in seqs.items()}
    for step in range(3):
        out = batched.step({key: [toks[prompt[key] + step]] for key, toks in seqs.items()}, pad_to=4)
        for key in seqs:
            logits[key].append(out[key])
    for key, toks in seqs.items():
        got = torch.cat(logits[key])
        assert (got - alone[key]).abs().max().item() < BATCH_ATOL
        assert torch.equal(got.argmax(-1), alone[key].argmax(-1))
        assert (got - hf_logits(path, toks)).abs().max().item() < ATOL
    assert batched.null_block_is_zero() and batched.null_block_writes.item() == 0


@pytest.mark.parametrize("case", ["mixtral", "deepseek-v3-noaux-q-lora", "deepseek-v2-greedy-no-q-lora-yarn"])
def test_chunked_prefill_in_a_mixed_batch_matches_transformers(case, checkpoints):
    """A prompt's second chunk attends over its cached first chunk while sharing
    the step with another request's decode (not decode_only, padded)."""
    path = checkpoints(case)
    runner = PagedRunner(engine_config(path))
    vocab = runner.config.model.vocab_size
    chunked, other = random_tokens(30, vocab, seed=21), random_tokens(6, vocab, seed=22)
    first = runner.step({"chunked": chunked[:17], "other": other[:5]}, pad_to=32)
    second = runner.step({"chunked": chunked[17:], "other": other[5:]}, pad_to=32)
    got = torch.cat([first["chunked"], second["chunked"]])
    assert (got - hf_logits(path, chunked)).abs().max().item() < ATOL
    got_other = torch.cat([first["other"], second["other"]])
    assert (got_other - hf_logits(path, other)).abs().max().item() < ATOL


def test_nan_in_mla_null_block_reaches_requests_reading_it(checkpoints):
    """The hazard is real: MLA attention reads padded block-table entries (block 0) and
    masks them after reading, so a poisoned null block turns a shorter request into NaN."""
    runner = PagedRunner(engine_config(checkpoints("deepseek-v3-noaux-q-lora")))
    vocab = runner.config.model.vocab_size
    short, long = random_tokens(3, vocab, seed=1), random_tokens(13, vocab, seed=2)
    runner.step({"short": short[:2]})
    runner.step({"long": long[:12]})
    clean = runner.step({"short": [short[2]], "long": [long[12]]}, pad_to=4)
    assert all(torch.isfinite(v).all() for v in clean.values())

    runner.caches[0][0].fill_(float("nan"))  # block 0 of layer 0's latent cache
    poisoned = runner.step({"short": [short[0]], "long": [long[0]]}, pad_to=4)
    assert torch.isnan(poisoned["short"]).all()    # its table row reads block 0 as padding
    assert torch.isfinite(poisoned["long"]).all()  # reads only its own blocks


def test_stacked_experts_follow_the_checkpoint_names(checkpoints):
    model = load_model(engine_config(checkpoints("mixtral")))
    names = model.expected_weights()
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(name.endswith(".experts.gate_up_proj") for name in names)
    experts = model.model.layers[0].block_sparse_moe.experts
    assert isinstance(experts, StackedExperts) and len(experts.owned) == 4
    assert len(experts.packed) == 4 and experts.gate_up_proj.numel() == 0  # packed for oneDNN, stack released


def test_deepseek_modules_match_config(checkpoints):
    model = load_model(engine_config(checkpoints("deepseek-v3-noaux-q-lora")))
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "gate")  # first_k_dense_replace = 1
    assert isinstance(layers[1].mlp.gate, DeepseekV3Router)
    assert layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0  # loaded, not the zero init
    assert isinstance(layers[0].self_attn, MLAAttention) and hasattr(layers[0].self_attn, "q_a_proj")
    v2 = load_model(engine_config(checkpoints("deepseek-v2-greedy-no-q-lora-yarn")))
    assert isinstance(v2.model.layers[1].mlp.gate, DeepseekV2Router)
    assert hasattr(v2.model.layers[0].self_attn, "q_proj")


def test_router_weights_stay_float32_in_bfloat16_models(checkpoints):
    config = engine_config(checkpoints("deepseek-v3-noaux-q-lora"), dtype="bfloat16")
    model = load_model(config)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    runner = PagedRunner(config, model)
    tokens = random_tokens(9, config.model.vocab_size, seed=5)
    logits = runner.run_sequence("r", tokens, 6).float()
    expected = hf_logits(checkpoints("deepseek-v3-noaux-q-lora"), tokens)
    assert torch.isfinite(logits).all()
    # bf16 vs the float32 reference: same ranking where the reference is decisive.
    top2 = expected.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 0.5
    assert torch.equal(logits.argmax(-1)[decisive], expected.argmax(-1)[decisive])


def test_mtp_and_rotary_tensors_are_skipped(checkpoints):
    model = load_model(engine_config(checkpoints("deepseek-v3-noaux-q-lora")))
    num_layers = model.config.model.num_layers
    assert not model.wants_weight(f"model.layers.{num_layers}.mlp.experts.0.gate_proj.weight")
    assert not model.wants_weight(f"model.layers.{num_layers}.eh_proj.weight")
    assert not model.wants_weight("model.layers.0.self_attn.rotary_emb.inv_freq")
    assert model.wants_weight("model.layers.1.mlp.experts.7.down_proj.weight")
