"""Sampling through the offline LLM on tiny-llama: greedy, seeds, filters, logprobs, penalties, stops;
and the sampler's top-k, top-p and min-p at ordinary values against a reference distribution."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import math
import shutil
from collections import Counter

import pytest
import torch

from service.demo.tokenizer import EOS_ID
from engine.engine_core.engine_core import EngineCore
from engine.frontend.llm import LLM
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams as SP
from tests.engine.test_sampler import reference_distribution, chi_square_p_value, MIN_P_VALUE

PROMPT = "hello world the cache"
REPEAT_PROMPT = "the cache the cache the cache the cache the cache"


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("tiny-llama")


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(ckpt, num_gpu_blocks=512, block_size=16, max_model_len=256, dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_model(ckpt):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits, [len(tokens), vocab]: row i predicts token i + 1."""
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def one(llm: LLM, prompt, params: SP):
    [out] = llm.generate([prompt], params)
    return out.outputs[0]


def greedy_tokens(llm: LLM, prompt=PROMPT, n: int = 16) -> list[int]:
    return one(llm, prompt, SP(temperature=0.0, max_tokens=n, ignore_eos=True)).token_ids


def run_core(engine: EngineCore, prompt_ids: list[int], params: SP, eos: int | None):
    """Drive the engine core directly (to choose the request's EOS id)."""
    engine.add_request(EngineRequest("core-req", prompt_ids, params, eos_token_id=eos))
    tokens, finish, stop_reason = [], None, None
    for _ in range(1000):
        for out in engine.step():
            if out.request_id != "core-req":
                continue
            tokens += out.new_token_ids
            if out.finish_reason:
                finish, stop_reason = out.finish_reason, out.stop_reason
        if finish:
            break
    assert not engine.has_unfinished
    return tokens, finish, stop_reason


# ------------------------------------------------------------------------------ greedy and filters

def test_greedy_is_argmax_of_model_logits(llm, hf_model):
    prompt_ids = llm.tokenizer.encode(PROMPT)
    out = one(llm, PROMPT, SP(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    lps = hf_logprobs(hf_model, prompt_ids + out.token_ids)
    expected = lps[len(prompt_ids) - 1:-1].argmax(dim=-1).tolist()
    assert out.token_ids == expected


def test_top_k_1_equals_greedy(llm):
    ref = greedy_tokens(llm)
    assert one(llm, PROMPT, SP(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True)).token_ids == ref
    assert one(llm, PROMPT, SP(temperature=5.0, top_k=1, max_tokens=16, ignore_eos=True)).token_ids == ref


def test_min_p_near_one_equals_greedy(llm):
    ref = greedy_tokens(llm)
    out = one(llm, PROMPT, SP(temperature=1.0, min_p=0.999, max_tokens=16, ignore_eos=True))
    assert out.token_ids == ref


def test_tiny_top_p_equals_greedy(llm):
    ref = greedy_tokens(llm)
    out = one(llm, PROMPT, SP(temperature=1.0, top_p=1e-6, max_tokens=16, ignore_eos=True))
    assert out.token_ids == ref


def test_unseeded_sampling_varies(llm):
    params = SP(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([PROMPT] * 4, params)
    runs = {tuple(o.outputs[0].token_ids) for o in outs}
    runs.add(tuple(one(llm, PROMPT, params).token_ids))
    assert len(runs) >= 4


def test_seeded_sampling_same_alone_and_in_busy_batch(llm):
    seeded = SP(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = one(llm, PROMPT, seeded).token_ids
    assert one(llm, PROMPT, seeded).token_ids == alone  # reproducible
    others = [("a b c d e f g", SP(temperature=1.0, max_tokens=30, ignore_eos=True)),
              ("x", SP(temperature=0.7, top_k=20, max_tokens=5, ignore_eos=True)),
              (REPEAT_PROMPT, SP(temperature=1.0, seed=99, max_tokens=40, ignore_eos=True)),
              ("model token request", SP(temperature=1.3, top_p=0.5, max_tokens=12)),
              ("server", SP(temperature=0.0, max_tokens=20, ignore_eos=True)),
              ("q" * 70, SP(temperature=1.0, seed=1235, max_tokens=17, ignore_eos=True)),
              ("layer attention", SP(temperature=0.9, min_p=0.1, max_tokens=9, ignore_eos=True)),
              ("python code", SP(temperature=1.0, presence_penalty=1.0, max_tokens=33, ignore_eos=True))]
    prompts = [p for p, _ in others[:4]] + [PROMPT] + [p for p, _ in others[4:]]
    params = [sp for _, sp in others[:4]] + [seeded] + [sp for _, sp in others[4:]]
    outs = llm.generate(prompts, params)
    assert outs[4].outputs[0].token_ids == alone
    other_seed = one(llm, PROMPT, SP(temperature=1.0, top_p=0.9, seed=4321, max_tokens=24, ignore_eos=True))
    assert other_seed.token_ids != alone


def test_seeded_sampling_independent_of_prefix_cache_hits(llm):
    """A warm prefix cache (second run hits) must not change a seeded request's tokens."""
    long_prompt = "the model token request server cache block batch layer attention expert router " * 2
    seeded = SP(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    first = llm.generate([long_prompt], seeded)[0]
    second = llm.generate([long_prompt], seeded)[0]
    assert second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


# ------------------------------------------------------------------------------ filters at ordinary values

# Distinct logits, no top-p or min-p boundary near a tie, token ids shuffled against rank.
def test_engine_applies_ordinary_filters_to_the_model_distribution(llm, hf_model):
    """The parameters reach the sampler through LLM.generate: 300 first tokens at top_k=5 stay
    in transformers' top 5 and fit the reference (300 draws catch a top-k off by one, not a
    wrong temperature; the test above covers that)."""
    logprobs = hf_logprobs(hf_model, llm.tokenizer.encode(PROMPT))[-1]
    fifth, sixth = torch.topk(logprobs, 6).values[4:].tolist()
    assert fifth - sixth > 1e-3, "the top-5 boundary is a near tie on this checkpoint: pick another prompt"
    expected = reference_distribution(logprobs, temperature=0.7, top_k=5)
    [out] = llm.generate([PROMPT], SP(n=300, seed=5, max_tokens=1, temperature=0.7, top_k=5))
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in out.outputs]), minlength=len(logprobs))
    assert counts[expected == 0].sum() == 0, f"drawn outside the top 5: {counts.nonzero().view(-1).tolist()}"
    assert chi_square_p_value(counts, expected) > MIN_P_VALUE


# ------------------------------------------------------------------------------ logprobs

def test_logprobs_top_n_sorted_and_match_transformers(llm, hf_model):
    prompt_ids = llm.tokenizer.encode(PROMPT)
    for params in (SP(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True),
                   SP(temperature=1.0, seed=3, max_tokens=8, logprobs=5, ignore_eos=True)):
        out = one(llm, PROMPT, params)
        ref = hf_logprobs(hf_model, prompt_ids + out.token_ids)[len(prompt_ids) - 1:-1]
        assert len(out.logprobs) == len(out.token_ids) == 8
        cumulative = 0.0
        for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert token in entry
            ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None)
            assert [r for r, _, _ in ranked] == [1, 2, 3, 4, 5]
            values = [v for _, _, v in ranked]
            assert values == sorted(values, reverse=True)
            assert len(entry) in (5, 6)  # the chosen token is added when outside the top 5
            expected_top = torch.topk(ref[pos], 5)
            assert [tid for _, tid, _ in ranked] == expected_top.indices.tolist()
            for _, tid, value in ranked:
                assert value == pytest.approx(ref[pos, tid].item(), abs=1e-4)
            assert entry[token].logprob == pytest.approx(ref[pos, token].item(), abs=1e-4)
            cumulative += entry[token].logprob
        assert out.cumulative_logprob == pytest.approx(cumulative, abs=1e-5)


def test_logprobs_zero_gives_only_chosen_token(llm):
    out = one(llm, PROMPT, SP(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True))
    assert len(out.logprobs) == 6
    for token, entry in zip(out.token_ids, out.logprobs):
        assert list(entry) == [token]
        assert entry[token].logprob <= 0.0 and math.isfinite(entry[token].logprob)
    assert one(llm, PROMPT, SP(temperature=0.0, max_tokens=3)).logprobs is None


def test_mixed_logprob_counts_in_one_batch(llm):
    outs = llm.generate([PROMPT, PROMPT, PROMPT],
                        [SP(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True),
                         SP(temperature=0.0, max_tokens=4, logprobs=7, ignore_eos=True),
                         SP(temperature=0.0, max_tokens=4, ignore_eos=True)])
    assert len(outs[0].outputs[0].logprobs) == len(outs[1].outputs[0].logprobs) == 4
    for entry in outs[0].outputs[0].logprobs:
        assert sum(lp.rank is not None for lp in entry.values()) == 2
    for entry in outs[1].outputs[0].logprobs:
        assert sum(lp.rank is not None for lp in entry.values()) == 7
    assert outs[2].outputs[0].logprobs is None


def test_prompt_logprobs(llm, hf_model):
    prompt_ids = llm.tokenizer.encode(PROMPT)
    [out] = llm.generate([PROMPT], SP(temperature=0.0, max_tokens=2, prompt_logprobs=3))
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt_ids)
    assert plp[0] is None
    ref = hf_logprobs(hf_model, prompt_ids)
    for i in range(1, len(prompt_ids)):
        entry = plp[i]
        assert prompt_ids[i] in entry
        assert entry[prompt_ids[i]].logprob == pytest.approx(ref[i - 1, prompt_ids[i]].item(), abs=1e-4)
        assert sum(lp.rank is not None for lp in entry.values()) == 3


def test_prompt_logprobs_with_n_samples(llm):
    prompt_ids = llm.tokenizer.encode(PROMPT)
    [out] = llm.generate([PROMPT], SP(n=2, temperature=1.0, max_tokens=3, prompt_logprobs=1))
    assert len(out.outputs) == 2
    assert len(out.prompt_logprobs) == len(prompt_ids)


def test_prompt_logprobs_with_chunked_prefill(ckpt, hf_model):
    prompt_ids = [0] + list(range(10, 60))
    with LLM(ckpt, num_gpu_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=16, dtype="float32") as small:
        [out] = small.generate([prompt_ids], SP(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    ref = hf_logprobs(hf_model, prompt_ids)
    assert len(out.prompt_logprobs) == len(prompt_ids) and out.prompt_logprobs[0] is None
    got = [out.prompt_logprobs[i][prompt_ids[i]].logprob for i in range(1, len(prompt_ids))]
    want = [ref[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))]
    assert got == pytest.approx(want, abs=1e-4)


# ------------------------------------------------------------------------------ penalties

def _repeats(tokens: list[int], prompt: list[int]) -> int:
    seen, count = set(prompt), 0
    for t in tokens:
        count += t in seen
        seen.add(t)
    return count


def test_repetition_penalty_reduces_repeats(llm):
    prompt_ids = llm.tokenizer.encode(REPEAT_PROMPT)
    plain = one(llm, REPEAT_PROMPT, SP(temperature=0.0, max_tokens=40, ignore_eos=True)).token_ids
    penalized = one(llm, REPEAT_PROMPT, SP(temperature=0.0, max_tokens=40, ignore_eos=True,
                                           repetition_penalty=2.0)).token_ids
    assert _repeats(plain, prompt_ids) > 0
    assert _repeats(penalized, prompt_ids) < _repeats(plain, prompt_ids)
    # The penalty covers prompt tokens too: none of them comes back.
    assert not set(penalized) & set(prompt_ids)


def test_presence_and_frequency_penalties_change_output(llm):
    base = SP(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = one(llm, REPEAT_PROMPT, base).token_ids
    presence = one(llm, REPEAT_PROMPT, SP(temperature=0.0, max_tokens=40, ignore_eos=True,
                                          presence_penalty=2.0)).token_ids
    frequency = one(llm, REPEAT_PROMPT, SP(temperature=0.0, max_tokens=40, ignore_eos=True,
                                           frequency_penalty=2.0)).token_ids
    assert presence != plain and frequency != plain
    # They act on output tokens only: up to the first repeat in the plain output, nothing changes.
    first_repeat = next(i for i, t in enumerate(plain) if t in plain[:i])
    assert presence[:first_repeat] == plain[:first_repeat]
    assert frequency[:first_repeat] == plain[:first_repeat]
    assert presence[first_repeat] != plain[first_repeat]
    # Negative penalties encourage repetition.
    negative = one(llm, REPEAT_PROMPT, SP(temperature=0.0, max_tokens=40, ignore_eos=True,
                                          frequency_penalty=-2.0)).token_ids
    assert max(Counter(negative).values()) > max(Counter(plain).values())


# ------------------------------------------------------------------------------ stopping

def test_max_tokens_gives_length(llm):
    out = one(llm, PROMPT, SP(temperature=1.0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.stop_reason is None


def test_eos_stops_and_ignore_eos_continues(llm):
    # Greedy "hello" reaches the tokenizer's EOS on this checkpoint.
    out = one(llm, "hello", SP(temperature=0.0, max_tokens=60))
    assert llm.tokenizer.eos_token_id == EOS_ID
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS_ID and out.stop_reason is None
    assert EOS_ID not in out.token_ids[:-1]
    n = len(out.token_ids)
    longer = one(llm, "hello", SP(temperature=0.0, max_tokens=n + 5, ignore_eos=True))
    assert longer.finish_reason == "length" and len(longer.token_ids) == n + 5
    assert longer.token_ids[:n] == out.token_ids


def test_eos_chosen_by_request_and_min_tokens(llm):
    engine = llm.engine
    prompt_ids = llm.tokenizer.encode(PROMPT)
    ref = greedy_tokens(llm, PROMPT, 8)
    g = ref[0]
    tokens, finish, stop_reason = run_core(engine, prompt_ids, SP(temperature=0.0, max_tokens=8), eos=g)
    assert tokens == [g] and finish == "stop" and stop_reason is None
    tokens, finish, _ = run_core(engine, prompt_ids, SP(temperature=0.0, max_tokens=8, min_tokens=3), eos=g)
    assert len(tokens) >= 3 and tokens[0] != g and g not in tokens[:3]
    if g in tokens:
        assert finish == "stop" and tokens[-1] == g
    else:
        assert finish == "length"
    tokens, finish, _ = run_core(engine, prompt_ids, SP(temperature=0.0, max_tokens=5, ignore_eos=True), eos=g)
    assert tokens[0] == g and len(tokens) == 5 and finish == "length"
    # min_tokens also holds back stop_token_ids.
    tokens, finish, _ = run_core(engine, prompt_ids, SP(temperature=0.0, max_tokens=6, min_tokens=2,
                                                        stop_token_ids=[g]), eos=None)
    assert tokens[0] != g and len(tokens) >= 2


def test_stop_token_ids(llm):
    ref = greedy_tokens(llm, PROMPT, 16)
    k = next(i for i in range(2, 16) if ref[i] not in ref[:i])
    out = one(llm, PROMPT, SP(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[ref[k], 9999]))
    assert out.finish_reason == "stop" and out.stop_reason == ref[k]
    assert out.token_ids == ref[:k + 1]


def test_every_generation_config_eos_id_stops(ckpt, tmp_path, llm):
    g = greedy_tokens(llm, PROMPT, 4)[0]
    assert g != EOS_ID
    path = tmp_path / "eos"
    shutil.copytree(ckpt, path)
    config = json.loads((path / "generation_config.json").read_text())
    assert isinstance(config["eos_token_id"], list) and len(config["eos_token_id"]) > 1
    config["eos_token_id"] = [EOS_ID, g]
    (path / "generation_config.json").write_text(json.dumps(config))
    with LLM(str(path), num_gpu_blocks=64, block_size=16, max_model_len=256, dtype="float32") as other:
        out = one(other, PROMPT, SP(temperature=0.0, max_tokens=8))
    assert out.token_ids == [g] and out.finish_reason == "stop"


def _stop_candidate(text: str) -> tuple[int, str]:
    for k in range(3, len(text) - 2):
        s = text[k:k + 2]
        if "\ufffd" not in s and s.isprintable() and text.find(s) == k:
            return k, s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings(llm):
    full = one(llm, PROMPT, SP(temperature=0.0, max_tokens=24, ignore_eos=True))
    k, stop = _stop_candidate(full.text)
    out = one(llm, PROMPT, SP(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:k]
    assert stop not in out.text
    assert full.token_ids[:len(out.token_ids)] == out.token_ids and len(out.token_ids) < 24
    inc = one(llm, PROMPT, SP(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                              include_stop_str_in_output=True))
    assert inc.text == full.text[:k + len(stop)] and inc.finish_reason == "stop"
    # The engine forgot the request once the stop string ended it.
    assert not llm.engine.has_unfinished


def test_stop_string_on_one_of_n_samples_is_aborted_in_engine(llm):
    base = dict(n=2, temperature=1.0, seed=21, max_tokens=30, ignore_eos=True)
    [full] = llm.generate([PROMPT], SP(**base))
    toks = [o.token_ids for o in full.outputs]
    texts = [o.text for o in full.outputs]
    # Sample 1 ends early on a stop token that sample 0 never samples; sample 0 ends early
    # (in the front end) on a stop string that sample 1 never produces.
    stop_token = next(t for t in toks[1][2:12] if t not in toks[0])
    stop = next(texts[0][k:k + 2] for k in range(2, len(texts[0]) // 2)
                if "\ufffd" not in texts[0][k:k + 2] and texts[0][k:k + 2] not in texts[1])
    [out] = llm.generate([PROMPT], SP(**base, stop=[stop], stop_token_ids=[stop_token]))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[1].finish_reason == "stop" and out.outputs[1].stop_reason == stop_token
    try:
        assert not llm.engine.has_unfinished, "sample 0 still runs in the engine after generate() returned"
    finally:
        llm.engine.abort([out.request_id])
        llm.engine.take_pending()
