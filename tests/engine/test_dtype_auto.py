"""`--dtype auto` (engine/placement.py): bfloat16 where the CPU has native bf16, float32 elsewhere
and on CUDA; an explicit dtype is kept; the config and the CLI default carry the choice and why."""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.placement import cpu_flags, resolve_dtype
from engine.engine_args import config_default


def test_auto_follows_the_cpus_bf16_flags():
    assert resolve_dtype("auto", "cpu", frozenset({"avx512f", "amx_bf16"}))[0] == "bfloat16"
    assert resolve_dtype("auto", "cpu", frozenset({"avx512f", "avx512_bf16"}))[0] == "bfloat16"
    dtype, reason = resolve_dtype("auto", "cpu", frozenset({"avx512f", "avx2"}))
    assert dtype == "float32" and "no native bf16" in reason
    assert resolve_dtype("auto", "cuda", frozenset({"amx_bf16"}))[0] == "float32"


def test_an_explicit_dtype_is_kept():
    assert resolve_dtype("float32", "cpu", frozenset({"amx_bf16"})) == ("float32", "asked for")
    assert resolve_dtype("bfloat16", "cpu", frozenset()) == ("bfloat16", "asked for")


def test_the_default_is_auto_and_the_config_says_why(checkpoint):
    assert config_default("dtype") == "auto"
    path = checkpoint("tiny-llama")
    config = EngineConfig.create(path, max_model_len=64, num_gpu_blocks=8)
    native = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    assert config.model.dtype == (torch.bfloat16 if native else torch.float32)
    assert config.dtype_reason.startswith("auto: ")
    exact = EngineConfig.create(path, max_model_len=64, num_gpu_blocks=8, dtype="float32")
    assert exact.model.dtype == torch.float32 and exact.dtype_reason == "asked for"
