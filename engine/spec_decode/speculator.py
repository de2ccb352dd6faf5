"""The engine core's side of speculation: after each step it asks the proposer for the next
drafts of every decoding request (the scheduler reads them from `Request.draft_token_ids`), and
after each verify step it records what was accepted (counters, the request's gate).

Requests that constrain or report every token fall back to plain decoding: a grammar (the
matcher would have to advance and roll back across the drafts) and logprobs (each accepted
token would need its own logprob entry). Everything else the sampler honours -- temperature,
top-k/top-p/min-p, penalties, min_tokens, seeds -- is honoured per verified position.
"""
from __future__ import annotations

from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.gate import AcceptanceGate, draft_threshold, step_pays
from engine.spec_decode.proposer import NgramProposer
from engine.spec_decode.stats import SpecDecodeStats


def speculates(request: Request) -> bool:
    """Whether a request may be given drafts at all (see the module docstring)."""
    return request.grammar is None and request.params.logprobs is None


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.proposer = NgramProposer(config)
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        self.gates: dict[str, AcceptanceGate] = {}  # request key -> its gate (running requests only)

    def propose(self, running: list[Request]) -> None:
        """Set the drafts of every running request for the next step: [] for most, and for all
        when verifying them would not pay for the step (gate.py)."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]  # not prefilling
        threshold = draft_threshold(len(decoding))
        gates, plans = {}, []
        for request in running:
            request.draft_token_ids = []
        for request in decoding:
            gate = gates[request.key] = self.gates.get(request.key) or AcceptanceGate()
            if not speculates(request):
                continue
            # Never draft past what the request may still emit: the step emits drafts + 1 tokens.
            room = min(request.params.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
            count = gate.num_drafts(min(room, self.proposer.k), threshold)
            drafts = self.proposer.propose(request.all_token_ids, count) if count > 0 else []
            if drafts:
                plans.append((request, drafts, gate.expected_accepted(len(drafts))))
        self.gates = gates
        expected = sum(e for _, _, e in plans)
        if plans and step_pays(expected, sum(len(d) for _, d, _ in plans), len(decoding)):
            for request, drafts, _ in plans:
                request.draft_token_ids = drafts

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        self.stats.record(num_drafts, num_accepted)
        gate = self.gates.get(request.key)
        if gate is not None:
            gate.record(num_drafts, num_accepted)
