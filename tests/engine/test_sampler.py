"""engine/worker/sampler.py on its own: top-k, top-p and min-p at ordinary values draw from the
filtered, renormalised distribution a plain-torch reference computes (chi-square), and never
draw a filtered-out token."""
from __future__ import annotations


import pytest
import torch

from engine.request import Request
from engine.sampling_params import SamplingParams as SP
from engine.worker.sampler import Sampler


FILTER_LOGITS = torch.tensor([3.0, 2.6, 2.2, 1.9, 1.5, 1.2, 0.8, 0.5, 0.1, -0.3, -0.8, -1.5, -2.0, -3.0, -4.0,
                              -6.0])[torch.randperm(16, generator=torch.Generator().manual_seed(0))]
NUM_DRAWS = 10_000
# A correct sampler scores p in 0.29-0.97 on these cases (seed 0); a filter off by one token,
# or a temperature ignored, scores below 1e-50 or draws a filtered-out token.
MIN_P_VALUE = 1e-4


def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                           min_p: float = 0.0) -> torch.Tensor:
    """The filters as vLLM defines them, token by token: the top_k most likely tokens; of
    those, the fewest most likely whose mass (renormalised over the top_k) reaches top_p; of
    those, each at least min_p times as likely as the most likely one; renormalised."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ranked = sorted(range(len(probs)), key=lambda t: -probs[t].item())
    candidates = ranked[:top_k] if top_k > 0 else ranked
    mass = sum(probs[t].item() for t in candidates)
    nucleus, covered = [], 0.0
    for token in candidates:
        if covered >= top_p:
            break
        nucleus.append(token)
        covered += probs[token].item() / mass
    kept = [t for t in nucleus if probs[t].item() >= min_p * probs[nucleus[0]].item()]
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness of fit of the counts to expected_probs; tokens expected fewer than 5 times
    share one bin."""
    expected = expected_probs * counts.sum()
    rare = expected < 5
    observed = torch.cat([counts[~rare].double(), counts[rare].sum().double().view(1)])
    expected = torch.cat([expected[~rare], expected[rare].sum().view(1)])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def sampler_counts(params: SP, num: int = NUM_DRAWS) -> torch.Tensor:
    """How often each token of FILTER_LOGITS is drawn in `num` rows through the engine's sampler."""
    requests = [Request(f"draw-{i}", 0, [1], params, None, 0.0) for i in range(num)]
    tokens, _ = Sampler(seed=0).sample(FILTER_LOGITS.expand(num, -1), requests)
    return torch.bincount(torch.tensor(tokens), minlength=len(FILTER_LOGITS))


FILTER_CASES = [  # (temperature, filters, how many tokens the reference keeps)
    (0.7, {}, 16), (1.0, {}, 16),
    (0.7, {"top_k": 5}, 5), (1.0, {"top_k": 5}, 5),
    (0.7, {"top_p": 0.7}, 3), (1.0, {"top_p": 0.7}, 4),
    (0.7, {"min_p": 0.1}, 5), (1.0, {"min_p": 0.1}, 7),
    # top-p over the top-8 renormalised keeps 6 (over the raw probabilities it would keep 7).
    (0.7, {"top_k": 8, "top_p": 0.9, "min_p": 0.1}, 5), (1.0, {"top_k": 8, "top_p": 0.9, "min_p": 0.1}, 6),
]


@pytest.mark.parametrize("temperature, filters, num_kept", FILTER_CASES,
                         ids=[f"T={t}-" + (",".join(f"{k}={v}" for k, v in f.items()) or "none")
                              for t, f, _ in FILTER_CASES])
def test_filters_sample_the_reference_distribution(temperature, filters, num_kept):
    expected = reference_distribution(FILTER_LOGITS, temperature, **filters)
    assert int((expected > 0).sum()) == num_kept
    counts = sampler_counts(SP(temperature=temperature, **filters))
    assert counts[expected == 0].sum() == 0, f"filtered-out tokens drawn: {counts.tolist()}"
    p_value = chi_square_p_value(counts, expected)
    assert p_value > MIN_P_VALUE, (f"p = {p_value:.3g}: counts {counts.tolist()}, "
                                   f"expected {[round(x, 1) for x in (expected * NUM_DRAWS).tolist()]}")
