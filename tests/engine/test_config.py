"""Configuration and request validation: every bad argument raises, naming what is wrong."""
from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, parse_dtype, parse_memory
from service.demo.checkpoint import write_preset
from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("tiny-llama")


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(ckpt, num_gpu_blocks=64, block_size=16, max_model_len=64, dtype="float32") as engine:
        yield engine


@pytest.fixture
def broken(ckpt, tmp_path):
    """A fresh copy of the checkpoint that a test may damage."""
    dest = tmp_path / "ckpt"
    shutil.copytree(ckpt, dest)
    return dest


# ------------------------------------------------------------------------------ sampling params

@pytest.mark.parametrize("field, kwargs", [
    ("n", dict(n=0)),
    ("n", dict(n=-2)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=1.5)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-5)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)),
    ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=21)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-3.0)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("stop", dict(stop=[""])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("seed", dict(seed=2**63)),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


def test_good_sampling_params_edges():
    SamplingParams(top_p=1.0, logprobs=20, prompt_logprobs=0, top_k=-1, min_p=1.0, temperature=0.0,
                   min_tokens=3, max_tokens=3, seed=-(2**63), repetition_penalty=10.0)
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy
    assert SamplingParams(logprobs=0).num_logprobs == 0 and SamplingParams().num_logprobs == -1


def test_sampling_params_are_immutable():
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.5


# ------------------------------------------------------------------------------ prompts

def test_empty_prompt_rejected(llm):
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished


def test_prompt_longer_than_max_model_len_rejected(llm):
    with pytest.raises(ValueError, match="^prompt:.*max_model_len"):
        llm.generate([[5] * 64], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=2))
    [out] = llm.generate([[5] * 63], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_out_of_vocab_prompt_token_rejected(llm):
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate([[5, 512]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate([[5, -1]], SamplingParams(max_tokens=2))


def test_bad_prompt_type_and_param_count(llm):
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate([[1.5, 2]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^params:"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2)])
    with pytest.raises(ValueError, match="^prompts:"):
        llm.generate([], SamplingParams(max_tokens=2))


def test_bad_prompt_in_batch_leaves_nothing_behind(llm):
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate([[5, 6, 7], []], SamplingParams(max_tokens=20))
    try:
        assert not llm.engine.has_unfinished
    finally:
        for request in list(llm.engine.scheduler.requests.values()):
            llm.engine.abort([request.request_id])
        llm.engine.take_pending()


# ------------------------------------------------------------------------------ engine arguments

def test_unknown_engine_argument(ckpt):
    with pytest.raises(ValueError, match="^max_num_seq:.*unknown"):
        EngineConfig.create(ckpt, max_num_seq=4, dtype="float32")
    with pytest.raises(ValueError, match="^num_blocks:"):
        EngineConfig.create(ckpt, num_blocks=4, dtype="float32")  # derived; the argument is num_gpu_blocks
    with pytest.raises(ValueError, match="^bogus:"):
        LLM(ckpt, bogus=True, dtype="float32")


@pytest.mark.parametrize("field, kwargs", [
    ("dtype", dict(dtype="float8")),
    ("dtype", dict(dtype="fp32")),
    ("nan_policy", dict(nan_policy="ignore")),
    ("nan_sentinel", dict(nan_sentinel="sometimes")),
    ("block_size", dict(block_size=12)),
    ("block_size", dict(block_size=0)),
    ("max_model_len", dict(max_model_len=4096)),  # the checkpoint allows 2048
    ("max_model_len", dict(max_model_len=0)),
    ("max_num_batched_tokens", dict(max_num_batched_tokens=0)),
    ("max_num_seqs", dict(max_num_seqs=0)),
    ("kv_cache_memory", dict(kv_cache_memory="1KiB")),
    ("kv_cache_memory", dict(kv_cache_memory="lots")),
    ("kv_cache_memory", dict(num_gpu_blocks=1)),
    ("data_parallel_size", dict(data_parallel_size=0)),
    ("data_parallel_rank", dict(data_parallel_size=2, data_parallel_rank=2)),
])
def test_bad_engine_args_name_the_field(ckpt, field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        EngineConfig.create(ckpt, **{"dtype": "float32", **kwargs})


def test_good_engine_config(ckpt):
    config = EngineConfig.create(ckpt, dtype="bfloat16", kv_cache_memory="1MiB", block_size=8,
                                 max_model_len=100, max_num_batched_tokens=300)
    assert config.model.dtype is torch.bfloat16
    per_block = 2 * 2 * 16 * 2 * 8 * 2  # k+v, kv heads, head_dim, bytes, block, layers
    assert config.num_blocks == 2**20 // per_block
    assert config.max_blocks_per_seq == 13
    assert config.padded_num_tokens(3) == 4 and config.padded_num_tokens(300) >= 300
    assert config.pad_buckets[-1] >= 300
    assert config.padded_num_tokens(10**6) == 10**6
    assert config.for_rank(0) == config and config.for_rank(0) is not config
    from engine.placement import resolve_dtype
    assert EngineConfig.create(ckpt, dtype="auto").model.dtype is getattr(torch, resolve_dtype("auto", "cpu")[0])
    assert EngineConfig.create(ckpt, dtype="float32").max_model_len == 2048


# ------------------------------------------------------------------------------ checkpoints

def test_unknown_architecture_named(broken):
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPT9000ForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT9000ForCausalLM"):
        EngineConfig.create(str(broken), dtype="float32")
    with pytest.raises(ValueError, match="GPT9000ForCausalLM"):
        LLM(str(broken), dtype="float32")


def test_missing_architectures_key(broken):
    config = json.loads((broken / "config.json").read_text())
    del config["architectures"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architecture"):
        ModelConfig.from_pretrained(broken)


def test_missing_config_json(broken):
    (broken / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(broken), dtype="float32")


def test_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"), dtype="float32")


def test_missing_tokenizer_json(broken):
    (broken / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LLM(str(broken), num_gpu_blocks=8, dtype="float32")


def test_missing_safetensors(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(broken), num_gpu_blocks=8, dtype="float32")


def test_missing_shard_named(ckpt, tmp_path):
    path = write_preset(tmp_path / "sharded", "tiny-llama", shards=2)
    shard = sorted(path.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        LLM(str(path), num_gpu_blocks=8, dtype="float32")


# ------------------------------------------------------------------------------ parsing helpers

@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 2**30),
    ("512MiB", 512 * 2**20),
    ("1.5GiB", int(1.5 * 2**30)),
    ("2G", 2 * 10**9),
    ("2GB", 2 * 10**9),
    ("64KiB", 64 * 1024),
    ("64K", 64_000),
    ("1TiB", 2**40),
    ("1e9", 10**9),
    ("123", 123),
    ("123B", 123),
    (" 4 MiB ", 4 * 2**20),
    (4096, 4096),
    (1.5e3, 1500),
])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "2 GiBs", "GiB", "-1GiB", "2PiB"])
def test_parse_memory_rejects(text):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory(text)


@pytest.mark.parametrize("text", ["1.2.3GiB", "eGiB", "+"])
def test_parse_memory_malformed_number_names_field(text):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory(text)


def test_parse_dtype():
    assert parse_dtype("float32") is torch.float32
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("float16") is torch.float16
    assert parse_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="^dtype:"):
        parse_dtype("half")


@pytest.mark.parametrize("max_tokens", [1, 100, 512, 2048, 8192])
def test_default_pad_buckets_bound_the_padding(max_tokens):
    from engine.config import default_pad_buckets
    buckets = default_pad_buckets(max_tokens)
    assert list(buckets) == sorted(set(buckets)) and buckets[:3] == (1, 2, 4)
    assert buckets[-1] >= max_tokens
    for n in range(1, max_tokens + 1):
        padded = next(b for b in buckets if b >= n)
        assert padded - n <= (7 if n <= 256 else 15 if n <= 1024 else 63) and (n <= 256 or padded < n * 1.07)
