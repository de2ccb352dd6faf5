"""benchmarks/make_1b_gguf.py, scaled down: the file it writes is a llama GGUF that kvsentry reads
as the shapes it was asked for, with the default model's tokenizer, whose blocks decode to one
shared draw in every format, and which the engine serves."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from benchmarks.make_1b_gguf import FORMATS, SMALL, write
from engine import LLM, SamplingParams
from engine.gguf.default_model import default_model_path
from engine.gguf.hf_config import hf_config_from_gguf
from engine.gguf.reader import read_gguf
from engine.gguf.tokenizer import build_tokenizer
from engine.gguf.weights import dequantize


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("small-1b")
    return write(SMALL, {fmt: directory / f"small.{fmt}.gguf" for fmt in FORMATS}, default_model_path())


def test_config_is_the_requested_shapes(files):
    for fmt, path in files.items():
        hf = hf_config_from_gguf(read_gguf(path))
        assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
                hf["intermediate_size"], hf["vocab_size"]) == (128, 2, 4, 2, 256, 49152), fmt
        assert not hf.get("tie_word_embeddings"), fmt  # TinyLlama's LM head is its own tensor


def test_formats_are_what_they_say_and_share_one_draw(files):
    Q = gguf.GGMLQuantizationType
    weights = {}
    for fmt, path in files.items():
        file = read_gguf(path)
        assert file.tensors["blk.0.attn_q.weight"].ggml_type == Q[fmt]
        assert file.tensors["output.weight"].ggml_type == Q.Q8_0
        assert file.tensors["blk.0.attn_norm.weight"].ggml_type == Q.F32
        weights[fmt] = dequantize(file, file.tensors["blk.1.ffn_down.weight"])
    # Each is the same float32 draw rounded its own way: Q8_0 within a hundredth of Q4_x's error.
    assert torch.std(weights["Q8_0"]).item() == pytest.approx(0.02, rel=0.05)
    for fmt in ("Q4_0", "Q4_1"):
        error = (weights[fmt] - weights["Q8_0"]).abs().max().item()
        assert 0 < error < 0.02, fmt


def test_tokenizer_is_the_default_models(files):
    ours = read_gguf(files["Q4_0"]).metadata
    default = read_gguf(default_model_path()).metadata
    for key, value in default.items():
        if key.startswith("tokenizer."):
            assert ours[key] == value, key
    text = "Perplexity over a fixed English text, 2026."
    ids = [build_tokenizer(read_gguf(path)).backend.encode(text).ids for path in (files["Q4_0"], default_model_path())]
    assert ids[0] == ids[1] and len(ids[0]) > 5


def test_engine_serves_it(files):
    llm = LLM(str(files["Q4_1"]), max_model_len=128, dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first, again = (llm.generate(["Hello there", "A longer prompt of several words"], params) for _ in range(2))
    assert [len(o.outputs[0].token_ids) for o in first] == [6, 6]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert np.all([0 <= t < 49152 for o in first for t in o.outputs[0].token_ids])
