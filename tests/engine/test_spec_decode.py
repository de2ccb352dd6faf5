"""engine/spec_decode/ on its own: the --speculative-config shape, the n-gram proposer, the
acceptance gate, and rejection sampling (chi-square against the target distribution, position
by position), plus the sampler's verify path and the scheduler's lookahead bookkeeping."""
from __future__ import annotations

import argparse

import pytest
import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.engine_args import ENGINE_ARGS
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig, parse_speculative_config
from engine.spec_decode.gate import Q_PRIOR, RETRY_STEPS, AcceptanceGate, draft_threshold, step_pays
from engine.spec_decode.proposer import NgramProposer
from engine.spec_decode.rejection_sampler import accept_greedy, rejection_sample
from engine.worker.sampler import Sampler

MIN_P_VALUE = 1e-4


def chi_square_p(observed: list[float], expected: list[float]) -> float:
    """Pearson's goodness of fit; the p-value from the regularised upper incomplete gamma."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    dof = sum(1 for e in expected if e > 0) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# -- config ---------------------------------------------------------------------------------------

def test_config_takes_vllm_shape_and_refuses_other_methods():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, '
                                      '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert config == SpeculativeConfig("ngram", 5, 4, 2)
    assert parse_speculative_config(None) is None
    assert parse_speculative_config({"method": "ngram", "prompt_lookup_max": 1}).prompt_lookup_min == 1
    for bad, why in [('{"method": "eagle", "model": "x"}', "not supported"), ('{"method": "draft_model"}', "not supported"),
                     ("{not json", "not a JSON object"), ('{"num_speculative_tokens": 3}', "method"),
                     ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "unsupported key"),
                     ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                     ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min"),
                     ('{"method": "ngram", "num_speculative_tokens": "4"}', "integer")]:
        with pytest.raises(ValueError, match=why):
            parse_speculative_config(bad)
    flag = next(arg for arg in ENGINE_ARGS if arg.name == "speculative_config")
    assert flag.option == "--speculative-config" and flag.default is None
    with pytest.raises(argparse.ArgumentTypeError, match="eagle"):
        flag.type('{"method": "eagle"}')


# -- proposer, gate ---------------------------------------------------------------------------------

def test_proposer_takes_the_longest_suffix_match_latest_first():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1))
    # The 3-gram (2, 3, 4) occurs once earlier: its continuation wins over the later 1-gram match of 4.
    assert proposer.propose([1, 2, 3, 4, 7, 8, 9, 4, 6, 2, 3, 4]) == [7, 8, 9]
    assert proposer.propose([1, 5, 9, 5, 8, 5]) == [8, 5]              # latest match of the 1-gram (5)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2], max_drafts=2) == [3, 4]
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2], max_drafts=0) == []
    assert proposer.propose([1, 2, 3, 4, 5, 6]) == []                  # nothing repeats
    strict = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2))
    assert strict.propose([1, 5, 9, 5, 8, 5]) == []                    # only a 1-gram matches


def test_gate_drafts_what_pays_and_retries_after_a_pause():
    """One decoding request tries K drafts at the prior rate; a full batch of 8 fewer; a step
    where only an unlikely draft would be verified is not worth it; a request whose drafts keep
    failing stops proposing and gets fresh chances at doubling intervals."""
    assert draft_threshold(1) < 0.3 < 0.7 < draft_threshold(8) < Q_PRIOR
    assert AcceptanceGate().num_drafts(4, draft_threshold(1)) == 4
    assert 1 <= AcceptanceGate().num_drafts(4, draft_threshold(8)) < 4
    assert step_pays(3.0, 4, 1) and not step_pays(0.3, 4, 1)
    assert not step_pays(3.0, 4, 8) and step_pays(8 * 2.5, 8 * 3, 8)  # one quoting request of 8 does not pay
    gate = AcceptanceGate()
    pauses = []
    for _ in range(4):
        while (count := gate.num_drafts(4, draft_threshold(1))) > 0:  # fail every try until it stops
            gate.record(count, 0)
        steps = 1
        while gate.num_drafts(4, draft_threshold(1)) == 0:
            steps += 1
        pauses.append(steps)
    assert pauses == [RETRY_STEPS, 2 * RETRY_STEPS, 4 * RETRY_STEPS, 8 * RETRY_STEPS]
    gate.record(2, 2)  # accepted: the pause is short again
    assert gate.retry == RETRY_STEPS


# -- rejection sampling ---------------------------------------------------------------------------

def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert accept_greedy([5, 9, 7], [5, 6]) == [5, 9]
    assert accept_greedy([4, 6, 7], [5, 6]) == [4]


def test_rejection_sampling_follows_the_target_distribution_position_by_position():
    """Point-mass drafts [d0, d1] over a 6-token vocabulary: the first emitted token follows
    P0, the second (after d0 was accepted) P1, the third (after both) P2 -- chi-square. The
    version that forgets to take the rejected draft out of the residual fails the same test."""
    gen = torch.Generator().manual_seed(0)
    tables = [torch.distributions.Dirichlet(torch.ones(6)).sample() for _ in range(3)]
    tables[0] = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.15, 0.1])
    drafts = [1, 3]
    runs = [rejection_sample(lambda i: tables[i], drafts, gen) for _ in range(20_000)]

    def check(position: int, prefix: list[int], table: torch.Tensor) -> float:
        tokens = [r[position] for r in runs if r[:position] == prefix]
        counts = [tokens.count(t) for t in range(6)]
        return chi_square_p(counts, [len(tokens) * float(p) for p in table])

    assert check(0, [], tables[0]) > MIN_P_VALUE
    assert check(1, [1], tables[1]) > MIN_P_VALUE
    assert check(2, [1, 3], tables[2]) > MIN_P_VALUE
    assert all(1 <= len(r) <= 3 for r in runs) and any(len(r) == 3 for r in runs)

    def broken(target_probs, drafts, generator):  # residual still holds the draft
        if float(torch.rand(1, generator=generator)) < float(target_probs(0)[drafts[0]]):
            return [drafts[0]]
        return [int((target_probs(0) / torch.empty(6).exponential_(generator=generator)).argmax())]

    bad = [broken(lambda i: tables[i], drafts, gen)[0] for _ in range(20_000)]
    assert chi_square_p([bad.count(t) for t in range(6)], [20_000 * float(p) for p in tables[0]]) < 1e-10


def _request(params: SamplingParams, prompt: list[int], output: list[int]) -> Request:
    request = Request("r", 0, prompt, params, None, 0.0)
    request.all_token_ids += output
    return request


def test_sampler_verify_equals_sampling_one_token_at_a_time():
    """Greedy with a repetition penalty and min_tokens: position i is processed as if drafts[:i]
    were already sampled, so verify's run equals what `sample` picks token by token."""
    torch.manual_seed(0)
    vocab = 40
    logits = torch.randn(4, vocab) * 3                                      # [k + 1, vocab]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.5, min_tokens=3,
                            stop_token_ids=[7])
    prompt, output = [3, 9, 12], [20]
    sampler = Sampler(0)
    expected, context = [], list(output)
    for i in range(4):
        token = sampler.sample(logits[i:i + 1], [_request(params, prompt, context)])[0][0]
        expected.append(token)
        context.append(token)
    assert sampler.verify(logits, _request(params, prompt, output), expected[:3]) == expected
    wrong = [expected[0], (expected[1] + 1) % vocab, expected[2]]
    assert sampler.verify(logits, _request(params, prompt, output), wrong) == expected[:2]


# -- scheduler bookkeeping -------------------------------------------------------------------------

def test_lookahead_blocks_are_allocated_and_trimmed_back():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    request = _request(SamplingParams(max_tokens=50), list(range(10, 16)), [])
    assert kv.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    request.all_token_ids.append(99)                     # 7 tokens, 6 computed: a decode
    assert kv.blocks_needed(request, 1 + 4) == 1          # positions 6..10 reach block 2
    assert kv.allocate_slots(request, 5) and len(request.block_ids) == 3
    free_before = kv.pool.num_free_blocks
    request.num_computed_tokens = 7                       # 0 of 4 drafts accepted
    request.all_token_ids.append(98)
    kv.trim(request)
    assert len(request.block_ids) == 2 and kv.pool.num_free_blocks == free_before + 1
    assert kv.pool.take_unsealed()[-1] not in request.block_ids   # freed unhashed: its seal goes too
