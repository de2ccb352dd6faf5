"""A GGUF checkpoint's Q4_0 / Q4_1 / Q8_0 linears with int8 activations
(engine/models/int8_linear.py): by default on a CPU with AVX512-VNNI, every linear (fused q|k|v
and gate|up, o_proj, down_proj, the tied LM head) holds its blocks and nothing dense; the kernel
serves the very tokens and log-probs of the torch reference; the report names the path;
--quantized-activations none restores the exact dequantized weights."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models import int8_linear
from engine.models.cpu_gemm import PackedLinear, linear_paths
from tests.engine.int8_helpers import assert_fused_stack_matches_loop, assert_same_bits
from tests.engine.int8_helpers import vector_kernels  # noqa: F401 (a fixture the tests take)
from tests.engine.gguf_convert import write_gguf

Q = gguf.GGMLQuantizationType
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
PROMPTS = [[5, 9, 33, 2, 17], list(range(40, 71)), list(range(3, 100, 2))]


def _packed(llm: LLM) -> list[PackedLinear]:
    model = llm.engine.runner.model
    return [p for layer in model.model.layers for p in (layer.self_attn.qkv, layer.self_attn.o_proj.packed,
                                                        layer.mlp.gate_up, layer.mlp.down_proj.packed)
            ] + [model.lm_head.packed]


@pytest.fixture(scope="module")
def q4_0_file(tmp_path_factory, checkpoint):
    directory = checkpoint("tiny-llama")
    path = write_gguf(directory, tmp_path_factory.mktemp("int8") / "q.gguf",
                      qtype=lambda name, t: Q.Q8_0 if name.startswith(("token_embd", "output.")) else Q.Q4_0)
    return str(path), directory


def _llm(q4_0_file, **kwargs) -> LLM:
    path, directory = q4_0_file
    return LLM(path, tokenizer=directory, max_model_len=256, kv_cache_memory="8MiB", num_threads=1,
               enable_prefix_caching=False, **kwargs)


def test_kernel_serves_the_references_tokens_and_logprobs(q4_0_file, monkeypatch, vector_kernels):
    if not int8_linear.kernel_runs():
        pytest.skip("no VNNI (AVX512-VNNI nor AVX-VNNI) here: the reference alone runs")
    llm = _llm(q4_0_file, quantized_activations="auto", dtype="float32")  # auto: int8 where the kernel runs
    linears = _packed(llm)
    assert all(p.int8 is not None and p.int8.kernel for p in linears)
    # The blocks are the only copy: no panels, no oneDNN weight, no W^T.
    assert all(p.panels is None and p.wide_panels is None and not p.onednn and not hasattr(p, "weight_t")
               for p in linears)
    assert all(p.int8.blocks.dtype == torch.uint8 for p in linears)
    paths = linear_paths(llm.engine.runner.model)
    # "amx_int8+avx512_vnni" on CPUs with AMX-INT8 (larger batches on tiles), else "avx512_vnni",
    # or "avx_vnni" without AVX-512.
    kernels = "+".join(vector_kernels)
    assert paths["linear.qkv"] == f"int8_gemm(cpu_kernel({kernels})) on q4_0 blocks"
    assert paths["linear.lm_head"] == f"int8_gemm(cpu_kernel({kernels})) on q8_0 blocks"
    got = llm.generate(PROMPTS, PARAMS)
    llm.close()
    monkeypatch.setattr(int8_linear, "kernel_runs", lambda: False)
    reference = _llm(q4_0_file, quantized_activations="int8", dtype="float32")
    assert all(p.int8 is not None and not p.int8.kernel for p in _packed(reference))
    assert linear_paths(reference.engine.runner.model)["linear.qkv"] == "int8_gemm(torch_reference) on q4_0 blocks"
    want = reference.generate(PROMPTS, PARAMS)
    reference.close()
    assert_same_bits(want, got)


def test_the_fused_layer_stack_serves_the_loops_bits(q4_0_file):
    """The layers as one csrc op call the int8 kernel as the Python loop does: the same bits."""
    if not int8_linear.kernel_runs():
        pytest.skip("no VNNI (AVX512-VNNI nor AVX-VNNI) here: the reference runs in the loop")
    assert_fused_stack_matches_loop(lambda **kw: _llm(q4_0_file, **kw), PROMPTS, PARAMS)


def test_weights_stay_in_their_blocks(q4_0_file):
    """The linears and the embedding hold the file's blocks (the embedding gathers the very values
    of the dequantized table): the rank's weight bytes are at most 1.15x the file's tensor bytes."""
    from engine.gguf.reader import read_gguf
    from engine.models.block_embedding import BlockEmbedding
    llm = _llm(q4_0_file, quantized_activations="int8")
    model = llm.engine.runner.model
    embedding = model.model.embed_tokens
    assert isinstance(embedding, BlockEmbedding) and embedding.ggml_type == Q.Q8_0
    ids = torch.tensor([[0, 5, 17], [embedding.num_embeddings - 1, 3, 3]])
    exact = _llm(q4_0_file, quantized_activations="none")
    assert torch.equal(embedding(ids), exact.engine.runner.model.model.embed_tokens(ids))
    exact.close()
    held = sum(p.int8.nbytes for p in _packed(llm)) + embedding.nbytes
    held += sum(t.numel() * t.element_size() for t in model.parameters())  # norms; released weights are empty
    gguf_file = read_gguf(q4_0_file[0])
    sizes = {int(t): gguf.GGML_QUANT_SIZES[t] for t in Q}
    file_bytes = sum(int(np.prod(info.shape)) // sizes[info.ggml_type][0] * sizes[info.ggml_type][1]
                     for info in gguf_file.tensors.values())
    llm.close()
    assert held <= 1.15 * file_bytes, (held, file_bytes)


def test_blocks_are_never_dequantized(q4_0_file, monkeypatch):
    """On the int8 path the loader copies the linears' and the embedding's blocks and nothing
    else: only the norms are dequantized, and no dense weight is ever filled (a 4-bit file loads
    in about its own size)."""
    from engine.gguf import weights
    dequantized = []
    real = weights.dequantize
    monkeypatch.setattr(weights, "dequantize", lambda gguf_file, info, index=None:
                        dequantized.append(info.name) or real(gguf_file, info, index))
    llm = _llm(q4_0_file, quantized_activations="int8")
    model = llm.engine.runner.model
    llm.close()
    assert dequantized and all(name.endswith("norm.weight") for name in dequantized), dequantized
    # Each packed linear's weight is one element broadcast to its shape, or released.
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and weight is not None:
            assert weight.untyped_storage().nbytes() <= weight.element_size(), module


def test_none_keeps_the_exact_weights(q4_0_file):
    llm = _llm(q4_0_file, quantized_activations="none")
    assert all(p.int8 is None for p in _packed(llm))
    assert not any("int8" in path for path in linear_paths(llm.engine.runner.model).values())
    llm.close()


def test_the_setting_is_validated(q4_0_file):
    with pytest.raises(ValueError, match="quantized_activations: must be one of auto, int8, none"):
        EngineConfig.create(q4_0_file[0], tokenizer=q4_0_file[1], quantized_activations="int4")


def test_auto_follows_the_kernel(monkeypatch):
    assert int8_linear.int8_formats("int8", "cpu") == int8_linear.INT8_TYPES
    assert not int8_linear.int8_formats("none", "cpu")
    assert not int8_linear.int8_formats("int8", "cuda")
    monkeypatch.setattr(int8_linear, "kernel_runs", lambda: False)
    assert not int8_linear.int8_formats("auto", "cpu")
    monkeypatch.setattr(int8_linear, "kernel_runs", lambda: True)
    assert int8_linear.int8_formats("auto", "cpu") == int8_linear.INT8_TYPES
    # Where bf16 runs on AMX tiles, a file whose layers are all Q4_1 or Q8_0 keeps the exact
    # weights for those types (the tiles multiply from their blocks, faster from 16 rows up);
    # layers of any other type take int8, and the Q4_1 / Q8_0 head and embedding with them.
    monkeypatch.setattr(int8_linear, "bf16_tiles_run", lambda dtype: dtype == torch.bfloat16)
    for layers in ({Q.Q4_1}, {Q.Q8_0}, {Q.Q4_1, Q.Q8_0}, frozenset()):
        assert int8_linear.int8_formats("auto", "cpu", torch.bfloat16, frozenset(layers)) == {
            Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K}
    for layers in ({Q.Q4_0}, {Q.Q4_K, Q.Q6_K}, {Q.Q4_1, Q.Q5_0}):
        assert int8_linear.int8_formats("auto", "cpu", torch.bfloat16, frozenset(layers)) == int8_linear.INT8_TYPES
    assert int8_linear.int8_formats("auto", "cpu", torch.float32, frozenset({Q.Q4_1})) == int8_linear.INT8_TYPES
    assert int8_linear.int8_formats("int8", "cpu", torch.bfloat16, frozenset({Q.Q4_1})) == int8_linear.INT8_TYPES


def test_auto_beside_bf16_tiles_takes_one_path_for_the_model(q4_0_file, tmp_path, monkeypatch):
    """Where bf16 runs on AMX tiles, auto decides by the layers' type. Q4_0 layers take int8
    activations, and the Q8_0 LM head and embedding take it with them (the head on its blocks,
    the embedding gathering from them). Q4_1 layers keep the exact weights on the tiles, and so
    do the Q8_0 head and the embedding (dense, dequantized)."""
    if not int8_linear.kernel_runs():
        pytest.skip("no VNNI (AVX512-VNNI nor AVX-VNNI) here: auto takes no int8")
    from engine.gguf.reader import read_gguf
    from engine.models.block_embedding import BlockEmbedding
    assert read_gguf(q4_0_file[0]).layer_matrix_types() == {Q.Q4_0}  # the head and embedding are Q8_0
    monkeypatch.setattr(int8_linear, "bf16_tiles_run", lambda dtype: dtype == torch.bfloat16)
    llm = _llm(q4_0_file, quantized_activations="auto", dtype="bfloat16")
    model = llm.engine.runner.model
    paths = linear_paths(model)
    assert paths["linear.qkv"].startswith("int8_gemm(") and paths["linear.qkv"].endswith("on q4_0 blocks")
    assert paths["linear.lm_head"].startswith("int8_gemm(") and paths["linear.lm_head"].endswith("on q8_0 blocks")
    assert isinstance(model.model.embed_tokens, BlockEmbedding) and model.model.embed_tokens.ggml_type == Q.Q8_0
    out = llm.generate(PROMPTS, PARAMS)
    llm.close()
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in out)

    directory = q4_0_file[1]
    q4_1 = write_gguf(directory, tmp_path / "q4_1.gguf",
                      qtype=lambda name, t: Q.Q8_0 if name.startswith(("token_embd", "output.")) else Q.Q4_1)
    llm = _llm((str(q4_1), directory), quantized_activations="auto", dtype="bfloat16")
    model = llm.engine.runner.model
    paths = linear_paths(model)
    assert not any("int8" in path for path in paths.values()), paths
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert model.model.embed_tokens.weight.untyped_storage().nbytes() == model.model.embed_tokens.weight.numel() * 2
    out = llm.generate(PROMPTS, PARAMS)
    llm.close()
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in out)
