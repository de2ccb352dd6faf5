"""The verdict on two engines' greedy token ids for the same prompts, which every engine-vs-peer
benchmark ends with: a speed ratio between engines that computed different things is no comparison.

float32: the ids must be identical, request by request. bfloat16: two correct engines round
differently, so where the best two tokens are nearly tied one may pick the other; a divergence
is accepted only as such a near-tie. It is judged at its first differing token: kvsentry in
float32 (the offline LLM, prompt_logprobs) scores both sides' tokens after the prompt and the
common prefix, and the divergence is a near-tie when their float32 logprobs differ by less than
NEAR_TIE_LOGPROB. A divergence that is no near-tie is the peer's rounding when kvsentry's token is
float32's better one by at least that much: the peer's bf16 moved that pair past what rounding
moves it, kvsentry's did not (it ranks the two as float32 does). Any other divergence (kvsentry's
token float32's worse one by the threshold or more, or an output that ends early), or a missing
output, fails the run; the peer's rounding is counted and listed, not failed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

# What bfloat16 rounding does to a near-tie, measured by benchmarks/near_tie_threshold.py on the
# default model (serve.py's random-id prompts and their greedy continuations, ~4.6k positions;
# benchmarks/results/near-tie-threshold_2026-12-04_xeon-amx-2c_*.json): bf16 moves the logprob gap
# between the float32 top-2 tokens by 0.06 at the median, 0.27 at p99, 0.41 at p99.9 and 0.51 at
# most, for kvsentry and for vLLM's CPU build alike; where a bf16 engine's best token was not
# float32's, the float32 gap was at most 0.34. Two bf16 engines can pick different tokens only
# where the float32 gap is below the larger of their shifts there, so the bound is the largest
# shift measured: a divergence with a float32 gap of 0.5 or more is not rounding.
NEAR_TIE_LOGPROB = 0.5

# The float32 reference every bf16 divergence is judged by, and what float32 runs serve: the exact
# dequantized weights. A GGUF's default (`auto`) on a CPU with VNNI multiplies int8 activations, in
# float32 too: a reference that did would judge by a rounding of its own.
EXACT_FLOAT32 = {"dtype": "float32", "quantized_activations": "none"}

# (context token ids, candidate token id) -> the candidate's float32 logprob after the context.
Scorer = Callable[[list[tuple[list[int], int]]], list[float]]


@dataclass
class Divergence:
    label: str
    at: int                       # the first token where the two sides differ
    ours: int | None              # each side's token there (None: that side's output ended)
    theirs: int | None
    logprob_ours: float | None = None    # float32, after the prompt and the common prefix
    logprob_theirs: float | None = None

    @property
    def gap(self) -> float | None:
        if self.logprob_ours is None or self.logprob_theirs is None:
            return None
        return abs(self.logprob_ours - self.logprob_theirs)

    def near_tie(self, threshold: float) -> bool:
        return self.gap is not None and self.gap < threshold

    def peer_rounding(self, threshold: float) -> bool:
        """kvsentry's token is float32's better one by `threshold` or more."""
        return self.gap is not None and self.logprob_ours - self.logprob_theirs >= threshold


@dataclass
class Verdict:
    what: str
    dtype: str
    names: tuple[str, str]
    total: int = 0
    identical: int = 0
    near_tie: int = 0
    not_near_tie: int = 0
    peer_rounding: int = 0  # of not_near_tie: kvsentry's token float32's better one (bfloat16 only)
    missing: list[str] = field(default_factory=list)
    threshold: float | None = None  # bfloat16 only: the near-tie bound on the float32 logprob gap
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.missing and self.not_near_tie == self.peer_rounding

    def as_json(self) -> dict:
        return {"what": self.what, "dtype": self.dtype, "engines": list(self.names), "passed": self.passed,
                "requests": self.total, "identical": self.identical, "near_tie": self.near_tie,
                "not_near_tie": self.not_near_tie, "peer_rounding": self.peer_rounding, "missing": self.missing,
                "near_tie_threshold_logprob": self.threshold,
                "divergences": [asdict(d) | {"gap": d.gap} for d in self.divergences]}

    def summary(self) -> str:
        head = (f"{'PASS' if self.passed else 'FAIL'} {self.what} ({self.dtype}, {self.names[0]} vs "
                f"{self.names[1]}): {self.identical}/{self.total} identical")
        if self.dtype == "float32":
            head += f", {self.not_near_tie} differ (float32 outputs must be identical)"
        else:
            head += (f", {self.near_tie} near-ties, {self.not_near_tie} not near-ties (near-tie: the two "
                     f"tokens' float32 logprobs within {self.threshold}), {self.peer_rounding} of them "
                     f"{self.names[1]}'s rounding ({self.names[0]}'s token float32's better one)")
        if self.missing:
            head += f", {len(self.missing)} without an output ({', '.join(self.missing[:5])})"
        lines = [head]
        for d in self.divergences[:20]:
            gap = "" if d.gap is None else f", float32 logprobs {d.logprob_ours:.4f} vs {d.logprob_theirs:.4f}"
            tie = ""
            if self.threshold is not None:
                tie = " near-tie" if d.near_tie(self.threshold) else " NOT a near-tie"
                if d.peer_rounding(self.threshold):
                    tie += f" ({self.names[1]}'s rounding)"
            lines.append(f"  {d.label}: first difference at token {d.at}: {d.ours} vs {d.theirs}{gap}{tie}")
        if len(self.divergences) > 20:
            lines.append(f"  ... and {len(self.divergences) - 20} more (all in the JSON)")
        return "\n".join(lines)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; a length difference counts at the shorter's end."""
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if at == len(a) == len(b) else at


def judge(what: str, dtype: str, ours: Sequence[Sequence[int] | None], theirs: Sequence[Sequence[int] | None],
          prompts: Sequence[Sequence[int]], names: tuple[str, str], labels: Sequence[str] | None = None,
          score: Scorer | None = None, threshold: float = NEAR_TIE_LOGPROB) -> Verdict:
    """The verdict on `ours[i]` against `theirs[i]`, both greedy continuations of `prompts[i]`.
    In bfloat16 `score` (a float32 engine) judges each divergence; without it none is a near-tie."""
    if not len(ours) == len(theirs) == len(prompts):
        raise ValueError(f"{len(ours)} vs {len(theirs)} outputs for {len(prompts)} prompts")
    labels = list(labels) if labels is not None else [f"request {i}" for i in range(len(ours))]
    verdict = Verdict(what, dtype, names, total=len(ours), threshold=threshold if dtype != "float32" else None)
    for label, a, b in zip(labels, ours, theirs):
        if a is None or b is None:
            verdict.missing.append(label)
            continue
        at = first_difference(a, b)
        if at is None:
            verdict.identical += 1
            continue
        verdict.divergences.append(Divergence(label, at, a[at] if at < len(a) else None,
                                              b[at] if at < len(b) else None))
    if dtype != "float32" and score is not None:
        # Only a token against a token can be a near-tie; an output that ends early is not.
        index = {label: i for i, label in enumerate(labels)}
        scored = [d for d in verdict.divergences if d.ours is not None and d.theirs is not None]
        queries = []
        for d in scored:
            context = list(prompts[index[d.label]]) + list(ours[index[d.label]][:d.at])
            queries += [(context, d.ours), (context, d.theirs)]
        values = score(queries) if queries else []
        for k, d in enumerate(scored):
            d.logprob_ours, d.logprob_theirs = values[2 * k], values[2 * k + 1]
    for d in verdict.divergences:
        if verdict.threshold is not None and d.near_tie(verdict.threshold):
            verdict.near_tie += 1
        else:
            verdict.not_near_tie += 1
            if verdict.threshold is not None and d.peer_rounding(verdict.threshold):
                verdict.peer_rounding += 1
    return verdict


def transformers_scorer(model) -> Scorer:
    """A float32 transformers model as the scorer (benchmarks whose peer is transformers itself)."""
    import torch

    def score(queries: list[tuple[list[int], int]]) -> list[float]:
        values = []
        with torch.inference_mode():
            for context, token in queries:
                logits = model(torch.tensor([context])).logits[0, -1].float()
                values.append(torch.log_softmax(logits, dim=-1)[token].item())
        return values

    return score


class Float32Scorer:
    """kvsentry's offline LLM in float32 on `model` (a checkpoint dir or a .gguf file), its exact
    path (EXACT_FLOAT32): a candidate's logprob after a context is the last prompt logprob of
    context + [candidate]."""

    def __init__(self, model: str, max_model_len: int = 2048):
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from engine import LLM
        self.llm = LLM(model, max_model_len=max_model_len, enable_prefix_caching=False, **EXACT_FLOAT32)

    def __call__(self, queries: list[tuple[list[int], int]]) -> list[float]:
        from engine import SamplingParams
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outputs = self.llm.generate([context + [token] for context, token in queries], params)
        return [out.prompt_logprobs[-1][token].logprob for out, (_, token) in zip(outputs, queries)]

    def close(self) -> None:
        self.llm.close()
