"""Verifying drafts so that the output distribution is exactly the target model's.

The n-gram proposer's draft is a point mass: it proposes token x with probability 1. Standard
speculative rejection sampling (accept x with min(1, p(x) / q(x)), on rejection sample from
max(0, p - q) renormalised) then reads: accept x with probability p(x); on rejection sample
from p with x removed and renormalised. Per position, P(emit y) = p(x)[y = x] + (1 - p(x)) *
p(y)[y != x] / (1 - p(x)) = p(y): each emitted token follows the target distribution given the
tokens before it. After k accepted drafts one more token is sampled from the last position's p
(the "bonus" token), so a verify step emits between 1 and k + 1 tokens.

Greedy decoding is the degenerate case (p is one-hot on the argmax): accept while the argmax
equals the draft, then emit the argmax; the tokens are those of decoding one at a time.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def accept_greedy(target_tokens: list[int],  # [k + 1] the target's argmax at each verified position
                  drafts: list[int]) -> list[int]:  # [k]
    """The emitted tokens: the drafts while they equal the argmax, then the argmax."""
    assert len(target_tokens) == len(drafts) + 1
    out: list[int] = []
    for draft, target in zip(drafts, target_tokens):
        out.append(target)
        if target != draft:
            return out
    out.append(target_tokens[-1])
    return out


def draw(probs: torch.Tensor,  # [vocab] float32, sums to 1 (zeros allowed)
         generator: torch.Generator) -> int:
    """One token from `probs` by the exponential race (argmax p / Exp(1)), as the sampler draws."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / race).argmax())


def rejection_sample(target_probs: Callable[[int], torch.Tensor],  # position i -> [vocab] float32
                     drafts: list[int], generator: torch.Generator) -> list[int]:
    """The emitted tokens of one request's verify step. `target_probs(i)` is the target's
    distribution at verified position i (after drafts[:i]), asked lazily: positions past the
    first rejection are never processed."""
    out: list[int] = []
    for i, draft in enumerate(drafts):
        probs = target_probs(i)
        uniform = float(torch.rand(1, generator=generator))
        if uniform < float(probs[draft]):
            out.append(draft)
            continue
        residual = probs.clone()
        residual[draft] = 0.0  # p with x removed; draw() needs no renormalising (argmax is scale-free)
        # All of p on x but rounding: the draft is what p says.
        out.append(draw(residual, generator) if float(residual.sum()) > 0.0 else draft)
        return out
    out.append(draw(target_probs(len(drafts)), generator))
    return out
