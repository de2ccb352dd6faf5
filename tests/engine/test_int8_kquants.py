"""A GGUF checkpoint laid out as llama.cpp's Q4_K_M (Q4_K linears; Q6_K for the first layer's
attn_v and ffn_down and for the tied token embedding / LM head; Q5_0 where a row of K is not
whole super-blocks of 256, here o_proj's 64) on the int8-activation path
(engine/models/int8_linear.py): every linear and the embedding hold blocks, nothing dense; the
kernel serves the torch reference's very tokens and log-probs; the teacher-forced perplexity of
the int8 path is close to the exact one; the fused layer stack serves the loop's bits;
--quantized-activations none is the dequantized model."""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.gguf.reader import read_gguf
from engine.gguf.weights import gguf_weights
from engine.models import int8_linear
from engine.models.cpu_gemm import linear_paths
from tests.engine.int8_helpers import assert_fused_stack_matches_loop, assert_same_bits
from tests.engine.int8_helpers import vector_kernels  # noqa: F401 (a fixture the tests take)
from tests.engine.gguf_convert import write_gguf

Q = gguf.GGMLQuantizationType
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
PROMPTS = [[5, 9, 33, 2, 17], list(range(40, 71)), list(range(3, 100, 2))]


def _q4_k_m(name: str, tensor: torch.Tensor) -> Q:
    if tensor.shape[-1] % 256:
        return Q.Q5_0  # llama.cpp's fallback for Q4_K where rows are not whole super-blocks
    if name.startswith("token_embd") or name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
        return Q.Q6_K
    return Q.Q4_K


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory, checkpoint):
    # init_scale 0.15: logits peaked enough to measure a perplexity (about 4.1 nats a token against
    # the uniform 6.2), not so peaked that int8 rounding flips near-certain tokens as at 0.3.
    directory = checkpoint("tiny-llama", hidden_size=256, intermediate_size=512, head_dim=16,
                           tie_word_embeddings=True, init_scale=0.15)
    path = write_gguf(directory, tmp_path_factory.mktemp("kquant") / "q4_k_m.gguf", qtype=_q4_k_m)
    types = {info.name: info.ggml_type for info in read_gguf(path).tensors.values()}
    assert types["blk.0.attn_v.weight"] == types["token_embd.weight"] == Q.Q6_K
    assert types["blk.1.attn_q.weight"] == Q.Q4_K and types["blk.1.attn_output.weight"] == Q.Q5_0
    return str(path), directory


def _llm(file, **kwargs) -> LLM:
    path, directory = file
    return LLM(path, tokenizer=directory, max_model_len=256, kv_cache_memory="8MiB", num_threads=1,
               enable_prefix_caching=False, **kwargs)


def _linears(llm: LLM) -> list:
    model = llm.engine.runner.model
    return [p for layer in model.model.layers for p in (layer.self_attn.qkv, layer.self_attn.o_proj.packed,
                                                        layer.mlp.gate_up, layer.mlp.down_proj.packed)
            ] + [model.lm_head.packed]


def test_kernel_serves_the_references_tokens_and_logprobs(q4_k_m_file, monkeypatch, vector_kernels):
    if not int8_linear.kernel_runs():
        pytest.skip("no VNNI (AVX512-VNNI nor AVX-VNNI) here: the reference alone runs")
    llm = _llm(q4_k_m_file, quantized_activations="int8")
    linears = _linears(llm)
    assert all(p.int8 is not None and p.int8.kernel for p in linears)
    assert all(p.panels is None and p.wide_panels is None and not p.onednn for p in linears)
    paths = linear_paths(llm.engine.runner.model)
    kernel = f"int8_gemm(cpu_kernel({'+'.join(vector_kernels)})"
    assert paths["linear.lm_head"].startswith(kernel) and paths["linear.lm_head"].endswith(") on q6_k blocks")
    assert paths["linear.o_proj"].startswith(kernel) and paths["linear.o_proj"].endswith(") on q5_0 blocks")
    qkv = [layer.self_attn.qkv.int8 for layer in llm.engine.runner.model.model.layers]
    assert qkv[0].path.endswith(") on q4_k+q6_k blocks")  # q, k Q4_K; v Q6_K
    assert qkv[1].ggml_type == Q.Q4_K
    got = llm.generate(PROMPTS, PARAMS)
    llm.close()
    monkeypatch.setattr(int8_linear, "kernel_runs", lambda: False)
    reference = _llm(q4_k_m_file, quantized_activations="int8")
    assert all(p.int8 is not None and not p.int8.kernel for p in _linears(reference))
    want = reference.generate(PROMPTS, PARAMS)
    reference.close()
    assert_same_bits(want, got)


def test_the_fused_layer_stack_serves_the_loops_bits(q4_k_m_file):
    """The layers as one csrc op, the first layer's q|k|v in parts of two types included, give the
    Python loop's bits."""
    if not int8_linear.kernel_runs():
        pytest.skip("no VNNI (AVX512-VNNI nor AVX-VNNI) here: the reference runs in the loop")
    assert_fused_stack_matches_loop(lambda **kw: _llm(q4_k_m_file, **kw), PROMPTS, PARAMS)


def test_weights_stay_in_their_blocks(q4_k_m_file):
    """The linears hold the file's blocks and the embedding gathers ggml's dequantized values from
    the tied LM head's packed Q6_K blocks: at most 1.15x the file's tensor bytes."""
    from engine.models.block_embedding import BlockEmbedding
    llm = _llm(q4_k_m_file, quantized_activations="int8")
    model = llm.engine.runner.model
    embedding = model.model.embed_tokens
    assert isinstance(embedding, BlockEmbedding) and embedding.ggml_type == Q.Q6_K
    assert embedding.packed == int8_linear.kernel_runs()
    ids = torch.tensor([[0, 5, 17], [embedding.num_embeddings - 1, 3, 3]])
    exact = _llm(q4_k_m_file, quantized_activations="none")
    assert torch.equal(embedding(ids), exact.engine.runner.model.model.embed_tokens(ids))
    exact.close()
    held = sum(p.int8.nbytes for p in _linears(llm)) + embedding.nbytes
    held += sum(t.numel() * t.element_size() for t in model.parameters())  # norms; released weights are empty
    sizes = {int(t): gguf.GGML_QUANT_SIZES[t] for t in Q}
    file_bytes = sum(int(np.prod(info.shape)) // sizes[info.ggml_type][0] * sizes[info.ggml_type][1]
                     for info in read_gguf(q4_k_m_file[0]).tensors.values())
    llm.close()
    assert held <= 1.15 * file_bytes, (held, file_bytes)


def _teacher_forced_nll(llm: LLM, tokens: list[int]) -> torch.Tensor:  # [len - 1] nats
    out = llm.generate([tokens], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))[0]
    return -torch.tensor([out.prompt_logprobs[t][tokens[t]].logprob for t in range(1, len(tokens))])


def test_none_is_the_dequantized_model_and_int8_is_close(q4_k_m_file, tmp_path):
    """--quantized-activations none serves what an HF checkpoint of the dequantized weights serves
    (the same tokens and log-probs); the int8 path's perplexity over a text the exact model wrote
    is within 2% of the exact one's (measured 0.08%; Q4_0 and Q8_0 files of this checkpoint give
    0.2% and 1.9%: the tiny random model's own noise)."""
    path, directory = q4_k_m_file
    dense = tmp_path / "dequantized"
    shutil.copytree(directory, dense)
    (dense / "model.safetensors").unlink()
    gguf_file = read_gguf(path)
    hf = json.loads((dense / "config.json").read_text())
    weights = {name: t.contiguous() for name, t in gguf_weights(gguf_file, hf, lambda name: True)}
    save_file(weights, str(dense / "model.safetensors"))
    exact = _llm(q4_k_m_file, quantized_activations="none")
    assert all(p.int8 is None for p in _linears(exact))
    hf_model = LLM(str(dense), max_model_len=256, kv_cache_memory="8MiB", num_threads=1, enable_prefix_caching=False)
    want = hf_model.generate(PROMPTS, PARAMS)
    hf_model.close()
    got = exact.generate(PROMPTS, PARAMS)
    assert_same_bits(want, got)
    # A text of the exact model's own (sampled, so not only its top choices), teacher-forced.
    text = exact.generate([[7, 3, 11]], SamplingParams(temperature=1.0, seed=5, max_tokens=150, ignore_eos=True))
    tokens = [7, 3, 11] + text[0].outputs[0].token_ids
    nll_exact = _teacher_forced_nll(exact, tokens)
    exact.close()
    int8 = _llm(q4_k_m_file, quantized_activations="int8")
    nll_int8 = _teacher_forced_nll(int8, tokens)
    int8.close()
    ratio = float(torch.exp(nll_int8.mean() - nll_exact.mean()))
    assert abs(ratio - 1) < 0.02, ratio
    assert not torch.equal(nll_int8, nll_exact)  # another arithmetic
