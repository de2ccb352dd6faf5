"""Greedy outputs and teacher-forced log-probs match Hugging Face transformers."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

NEW_TOKENS = 64
ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]


def make_prompts(vocab: int, count: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 129, 200, 257, 301, 310][:count]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    # Two prompts share a long prefix with another, so the prefix cache has work to do.
    prompts[5] = prompts[12][:16]
    prompts[9] = prompts[13][:48] + prompts[9][:16]
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, checkpoint):
    """(path, prompts, transformers' greedy continuations)."""
    from transformers import AutoModelForCausalLM
    path = checkpoint(request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(model.config.vocab_size)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            # eos_token_id=None: the engine runs with ignore_eos, so the reference must too.
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return path, prompts, outputs, model


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

VARIANTS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=48),
    "preemption": dict(num_gpu_blocks=40, block_size=16, max_num_batched_tokens=512),
    "no_prefix_cache": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(reference, variant):
    path, prompts, expected, _ = reference
    llm = LLM(path, max_model_len=512, kv_cache_memory="64MiB", **{"dtype": "float32", **VARIANTS[variant]})
    outs = llm.generate(prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged ({variant})"
        assert out.outputs[0].finish_reason == "length"
    sched = llm.engine.scheduler
    if variant == "preemption":
        assert sched.num_preemptions > 0, "the block budget should have forced preemption"
    if variant in ("default", "no_prefix_cache"):
        # A second pass over the same prompts: now served from the prefix cache (when on).
        again = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == expected
        if variant == "default":
            assert sched.kv.prefix_hits > 0 and any(o.num_cached_tokens > 0 for o in again)
        else:
            assert sched.kv.prefix_hits == 0
    # Everything returned to the pool; the null block was never written.
    assert sched.kv.pool.num_free_blocks == llm.config.num_blocks - 1
    assert llm.engine.runner.null_block_writes.item() == 0


def test_single_prompt_alone(reference):
    path, prompts, expected, _ = reference
    llm = LLM(path, max_model_len=512, kv_cache_memory="16MiB", dtype="float32")
    for i in (0, 7, 14):
        assert llm.generate([prompts[i]], GREEDY)[0].outputs[0].token_ids == expected[i]


def test_teacher_forced_logprobs(reference):
    path, prompts, _, model = reference
    llm = LLM(path, max_model_len=512, kv_cache_memory="16MiB", max_num_batched_tokens=64, dtype="float32")
    chosen = [prompts[i] for i in (3, 8, 11, 14)]
    outs = llm.generate(chosen, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
    for prompt, out in zip(chosen, outs):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert out.prompt_logprobs[0] is None
        got = torch.tensor([out.prompt_logprobs[t][prompt[t]].logprob for t in range(1, len(prompt))])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
