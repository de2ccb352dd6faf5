"""GGUF checkpoints on tiny files the tests write: the header reader against gguf's own
GGUFReader, dequantization of every supported type, the inverse of llama.cpp's q/k row
permutation, metadata -> config, and every architecture end to end (a checkpoint converted
the way llama.cpp converts it serves exactly the tokens and log-probs of the checkpoint)."""
from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.gguf.hf_config import hf_config_from_gguf
from engine.gguf.reader import read_gguf
from engine.gguf.weights import dequantize, unpermute_rope_rows
from service.demo.checkpoint import write_preset
from tests.conftest import TEST_INIT_SCALE
from tests.engine import ggml_blocks
from tests.engine.gguf_convert import Q, llama_cpp_permute, write_gguf

K_QUANTS = {Q.Q4_K: (0,), Q.Q5_K: (0,), Q.Q6_K: (-2,)}  # byte offsets of each block's fp16 scale d


def _k_quant_blocks(qtype: gguf.GGMLQuantizationType, rows: tuple[int, ...], cols: int, seed: int) -> np.ndarray:
    """Random K-quant bytes (gguf cannot quantize K-quants) with sane fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(*rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    for offset in K_QUANTS[qtype]:
        start = offset % size
        data[..., start:start + 2] = scale
        if qtype != Q.Q6_K:  # dmin follows d
            data[..., start + 2:start + 4] = scale
    return data.reshape(*rows, cols // block * size)


@pytest.fixture(scope="module")
def all_types_file(tmp_path_factory):
    """A GGUF holding one tensor of each supported type, and assorted metadata."""
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("test.text", "naïve ✓")
    writer.add_array("test.strings", ["a", "bc", "<|im_end|>", ""])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, 1.25])
    writer.add_bool("test.flag", True)
    writer.add_uint64("test.big", 2**40)
    writer.add_float32("test.eps", 1e-5)
    originals = {}
    for qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
        values = rng.standard_normal((6, 256)).astype(np.float32)
        originals[qtype.name] = values
        if qtype == Q.F32:
            writer.add_tensor(qtype.name, values)
        elif qtype == Q.F16:
            writer.add_tensor(qtype.name, values.astype(np.float16))
        else:
            writer.add_tensor(qtype.name, gguf.quantize(values, qtype), raw_dtype=qtype)
    for seed, qtype in enumerate(K_QUANTS):
        writer.add_tensor(qtype.name, _k_quant_blocks(qtype, (3, 4), 512, seed), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, originals


def test_reader_matches_ggufs_own_reader(all_types_file):
    path, _ = all_types_file
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == pytest.approx(field.contents()), key
    assert ours.metadata["test.text"] == "naïve ✓" and ours.metadata["test.big"] == 2**40
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape.tolist()))
        assert info.offset == tensor.data_offset and info.ggml_type == tensor.tensor_type
        raw = np.asarray(ours.raw_bytes(info, tensor.n_bytes))
        assert np.array_equal(raw, np.asarray(tensor.data).view(np.uint8).reshape(-1)), tensor.name


def test_block_formats_decode_as_their_layout_says(all_types_file):
    """The loader's dequantization of each block format against a decoder written from the
    format's layout (tests/engine/ggml_blocks.py), which shares no code with the `gguf`
    package the loader calls."""
    path, _ = all_types_file
    file = read_gguf(path)
    checked = []
    for name, info in file.tensors.items():
        if name not in ggml_blocks.DECODERS:
            continue
        _, block, size = ggml_blocks.DECODERS[name]
        raw = np.asarray(file.raw_bytes(info, int(np.prod(info.shape)) // block * size))
        expected = ggml_blocks.decode(name, raw, info.shape)
        got = dequantize(file, info).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=name)
        assert np.abs(expected).max() > 0, name
        checked.append(name)
    assert sorted(checked) == sorted(ggml_blocks.DECODERS)


def test_dequantized_values(all_types_file):
    path, originals = all_types_file
    file = read_gguf(path)
    error = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q4_0": 0.4, "Q4_1": 0.4}
    for name, values in originals.items():
        got = dequantize(file, file.tensors[name]).numpy()
        assert got.shape == values.shape
        assert np.abs(got - values).max() <= error[name] * np.abs(values).max() + 1e-6, name
    for qtype in K_QUANTS:  # a stacked tensor: one slice dequantizes to that slice of the whole
        info = file.tensors[qtype.name]
        whole = dequantize(file, info)
        assert whole.shape == (3, 4, 512) and torch.isfinite(whole).all() and whole.abs().max() > 0
        assert torch.equal(dequantize(file, info, 1), whole[1])


def test_unpermute_inverts_llama_cpp_permute():
    weight = torch.randn(4 * 16, 24)
    assert not torch.equal(llama_cpp_permute(weight, 4), weight)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(weight, 4), 4), weight)
    bias = torch.randn(2 * 8)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(bias, 2), 2), bias)
    # Within a head llama.cpp puts row d/2 + i right after row i; the inverse undoes exactly that.
    rows = torch.arange(8.0).unsqueeze(1)
    assert llama_cpp_permute(rows, 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
CASES = {
    "llama": ("tiny-llama", {}),
    "llama-tied": ("tiny-llama", {"tie_word_embeddings": True}),
    "llama-biases": ("tiny-llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-linear-rope": ("tiny-llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-llama3-rope": ("tiny-llama", {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 16384}),
    "qwen2": ("tiny-qwen2", {}),
    "qwen2-yarn": ("tiny-qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 512}}),
    "qwen3": ("tiny-qwen3", {}),
    "mixtral": ("tiny-mixtral", {}),
    "qwen2-moe": ("tiny-qwen2-moe", {}),
    "qwen3-moe": ("tiny-qwen3-moe", {}),
    "deepseek-v2": ("tiny-deepseek-v2", {}),
    "deepseek-v3": ("tiny-deepseek-v3", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_serves_exactly_what_the_checkpoint_serves(case, tmp_path):
    """Converted as llama.cpp converts (F32), the GGUF gives bit-identical greedy tokens and
    log-probs: names, layouts, experts and hyper-parameters all came back."""
    preset, overrides = CASES[case]
    directory = str(write_preset(tmp_path / "hf", preset, init_scale=TEST_INIT_SCALE, **overrides))
    path = write_gguf(directory, tmp_path / f"{case}.gguf")
    prompts = [[5, 9, 33, 2, 17], [100, 3], list(range(40, 71))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    args = dict(max_model_len=256, kv_cache_memory="16MiB", num_threads=1)
    expected = LLM(directory, **{"dtype": "float32", **args}).generate(prompts, params)
    got = LLM(str(path), tokenizer=directory, **{"dtype": "float32", **args}).generate(prompts, params)
    for ref, out in zip(expected, got):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs


def test_each_expert_parallel_rank_dequantizes_only_its_experts(checkpoint, tmp_path):
    from engine.gguf.weights import gguf_weights
    from engine.models.registry import build_model
    directory = checkpoint("tiny-qwen3-moe")
    path = write_gguf(directory, tmp_path / "moe.gguf")
    config = EngineConfig.create(str(path), tokenizer=directory, data_parallel_size=2, kv_cache_memory="8MiB", dtype="float32")
    owned = []
    for rank in range(2):
        model = build_model(config.for_rank(rank))
        names = [name for name, _ in gguf_weights(read_gguf(path), config.model.hf_config, model.wants_weight)]
        assert set(names) == model.expected_weights()
        owned.append({int(n.split(".")[5]) for n in names if ".experts." in n})  # model.layers.L.mlp.experts.E
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    assert owned[0] | owned[1] == set(range(config.model.num_experts))


def test_config_from_metadata_matches_config_json(checkpoint, tmp_path):
    directory = checkpoint("tiny-deepseek-v3")
    gguf_config = EngineConfig.create(str(write_gguf(directory, tmp_path / "v3.gguf")), tokenizer=directory, dtype="float32")
    dir_config = EngineConfig.create(directory, dtype="float32")
    for field in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "kv_lora_rank", "qk_rope_head_dim", "num_experts", "tie_word_embeddings"):
        assert getattr(gguf_config.model, field) == getattr(dir_config.model, field), field
    assert gguf_config.model.tokenizer == directory and dir_config.model.tokenizer == directory
    hf = gguf_config.model.hf_config
    for key in ("first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size", "n_shared_experts"):
        assert hf[key] == dir_config.model.hf_config[key], key


# Each projection of tiny-llama stored as another type: HF module -> GGML type.
QUANTIZED = {"q_proj": Q.Q8_0, "k_proj": Q.Q4_1, "v_proj": Q.Q4_0, "o_proj": Q.BF16, "gate_proj": Q.F16,
             "up_proj": Q.Q8_0, "down_proj": Q.Q4_1, "embed_tokens": Q.Q8_0, "lm_head": Q.F16}
GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
                "token_embd": "embed_tokens", "output": "lm_head"}


def _round_trip(tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    values = tensor.float().numpy()
    if qtype == Q.F16:
        return torch.from_numpy(values.astype(np.float16).astype(np.float32))
    return torch.from_numpy(np.array(gguf.dequantize(gguf.quantize(values, qtype), qtype), dtype=np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_gguf_serves_its_dequantized_weights_exactly(checkpoint, tmp_path, dtype):
    """Q8_0, Q4_0, Q4_1, F16 and BF16 tensors, dequantized into the serving dtype, serve exactly
    what a checkpoint of the quantize -> dequantize round-tripped weights serves."""
    import shutil
    from safetensors.torch import load_file, save_file
    directory = checkpoint("tiny-llama")
    path = write_gguf(directory, tmp_path / "quantized.gguf",
                      qtype=lambda name, t: QUANTIZED[GGUF_MODULES[name.split(".")[-2]]])
    assert {info.ggml_type for info in read_gguf(path).tensors.values()} == set(QUANTIZED.values()) | {Q.F32}
    rounded = tmp_path / "rounded"
    shutil.copytree(directory, rounded)
    state = load_file(str(rounded / "model.safetensors"))
    state = {name: _round_trip(t, QUANTIZED[name.split(".")[-2]]) if name.split(".")[-2] in QUANTIZED else t
             for name, t in state.items()}
    save_file(state, str(rounded / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[5, 9, 33, 2, 17], list(range(40, 71))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    args = dict(max_model_len=128, kv_cache_memory="8MiB", num_threads=1, dtype=dtype)
    expected = LLM(str(rounded), **{"dtype": "float32", **args}).generate(prompts, params)
    # The exact dequantized weights (int8 activations are another arithmetic: test_int8_linear.py).
    got = LLM(str(path), tokenizer=directory, quantized_activations="none", **args).generate(prompts, params)
    for ref, out in zip(expected, got):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs


def test_transformers_reads_the_test_converter_like_llama_cpp_files(checkpoint, tmp_path):
    """The converter above follows llama.cpp: transformers' own GGUF loader, which undoes
    llama.cpp's permutation, rebuilds the checkpoint's logits from its file."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM
    directory = checkpoint("tiny-llama")
    path = write_gguf(directory, tmp_path / "llama.gguf")
    ids = torch.tensor([[5, 9, 33, 2, 17, 80, 81]])
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        EngineConfig.create(str(path), dtype="float32")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        EngineConfig.create(str(tmp_path / "missing.gguf"), dtype="float32")
    (tmp_path / "text.gguf").write_text("not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        hf_config_from_gguf(read_gguf(tmp_path / "text.gguf"))


def test_load_logs_its_time_and_draws_a_bar_only_on_a_terminal(checkpoint, tmp_path, caplog, capsys, monkeypatch):
    import logging
    import sys
    from engine.worker.loader import load_model
    directory = checkpoint("tiny-llama")
    config = EngineConfig.create(str(write_gguf(directory, tmp_path / "llama.gguf")), tokenizer=directory,
                                 kv_cache_memory="8MiB", dtype="float32")
    with caplog.at_level(logging.INFO, logger="engine.worker.loader"):
        load_model(config)
    assert re.search(r"loaded llama\.gguf \(\d+ tensors, float32\) in [\d.]+ s on DP rank 0", caplog.text)
    assert "dequantizing" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    load_model(config)
    assert "dequantizing llama.gguf" in capsys.readouterr().err
