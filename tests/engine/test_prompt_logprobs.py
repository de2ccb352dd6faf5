"""prompt_logprobs (vLLM's field) against transformers on tiny-llama, where the engine could go wrong:
a prompt split over several chunked-prefill steps, a prefix cache that already holds the prompt, n > 1
samples, and the rank of each prompt token.

The engine computes them in the prefill: position t's hidden state gives the logprob of prompt token
t + 1. A request that asks for them does not read the prefix cache (scheduler.py), as vLLM does: a
cached block has K/V but no hidden states, and recomputing its positions costs what the prefill costs.
It still fills the cache for others."""
from __future__ import annotations

import pytest
import torch

from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams

PROMPT_IDS = [1] + [(7 * i) % 200 + 10 for i in range(70)]  # 71 tokens: 5 chunks of 16, blocks of 16


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("tiny-llama")


@pytest.fixture(scope="module")
def reference(ckpt) -> torch.Tensor:  # [len(PROMPT_IDS), vocab]: row t predicts token t + 1
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([PROMPT_IDS])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(ckpt, num_gpu_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=16,
             enable_prefix_caching=True, dtype="float32") as engine:
        yield engine


def check(prompt_logprobs, reference: torch.Tensor, num_top: int) -> None:
    assert len(prompt_logprobs) == len(PROMPT_IDS) and prompt_logprobs[0] is None
    for t in range(1, len(PROMPT_IDS)):
        row, token, entry = reference[t - 1], PROMPT_IDS[t], prompt_logprobs[t]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4), t
        others = sorted((lp.logprob for tid, lp in entry.items() if tid != token), reverse=True)
        best = row.topk(num_top)
        want = [v for i, v in zip(best.indices.tolist(), best.values.tolist()) if i != token]
        assert others == pytest.approx(want, abs=1e-4), t


def test_chunked_prefill_matches_transformers(llm, reference):
    [out] = llm.generate([PROMPT_IDS], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3))
    check(out.prompt_logprobs, reference, 3)


def test_a_cached_prompt_is_recomputed_for_its_logprobs(llm, reference):
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([PROMPT_IDS], plain)
    [hit] = llm.generate([PROMPT_IDS], plain)
    assert hit.num_cached_tokens >= 64  # the cache holds the prompt's full blocks
    [out] = llm.generate([PROMPT_IDS], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, reference, 2)
    [after] = llm.generate([PROMPT_IDS], plain)
    assert after.num_cached_tokens >= 64 and after.outputs[0].token_ids == hit.outputs[0].token_ids


def test_n_samples_share_one_copy(llm, reference):
    [out] = llm.generate([PROMPT_IDS], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=2,
                                                      prompt_logprobs=0))
    assert len(out.outputs) == 3
    check(out.prompt_logprobs, reference, 0)


def test_rank_counts_the_more_likely_tokens(llm, reference):
    """The engine's message carries vLLM's rank of each prompt token (1 = most likely)."""
    from engine.messages import EngineRequest
    from engine.engine_core.engine_core import EngineCore
    assert isinstance(llm.engine, EngineCore)
    request = EngineRequest("rank", PROMPT_IDS, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    llm.engine.add_request(request)
    entries = []
    for _ in range(len(PROMPT_IDS)):  # five prefill steps, then the request ends
        entries += [e for out in llm.engine.step() for e in out.prompt_logprobs or []]
        if len(entries) == len(PROMPT_IDS):
            break
    assert entries[0] is None
    for t, entry in enumerate(entries[1:], start=1):
        row = reference[t - 1]
        low, high = (int((row > row[PROMPT_IDS[t]] + slack).sum()) + 1 for slack in (1e-4, -1e-4))
        assert entry.token_id == PROMPT_IDS[t] and low <= entry.rank <= high, t
