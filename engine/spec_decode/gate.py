"""When a request proposes, and how many drafts: speculation pays only when the tokens it is
expected to add outweigh what the extra query rows cost the whole step.

Cost model, in units of one decode row's cost (measured on the default model, float32, 1
thread, Xeon AMX, 2026-12-04: a step of B decode rows takes ~(FIXED_COST + B) units, each
verified draft adds ~1 unit, and a step that is not pure decode ~MIXED_COST more, whatever its
size). A step of B decoding requests that verifies D drafts and is expected to accept A of them
is worth it when (B + A) / (FIXED_COST + B + MIXED_COST + D) > B / (FIXED_COST + B), i.e.
A * (FIXED_COST + B) > B * (MIXED_COST + D). Per request, the m-th draft is only tried when
the chance that it and the ones before it are accepted, q^m, clears B / (FIXED_COST + B): one
client verifies up to K drafts at a modest acceptance rate, a full batch only near-certain ones.

q is each request's acceptance rate, decayed counts of accepted and decided drafts (a draft is
decided when accepted or when it is the first rejected one of its step). A new request starts
at Q_PRIOR, so its first drafts are tried. A request whose q keeps it from proposing gets a
fresh, cheaper chance (q reset to Q_PROBE) after `retry` decode steps, doubling from
RETRY_STEPS up to MAX_RETRY_STEPS while its probes fail: free text, where matches are rare and
mostly wrong, spends a vanishing share of its steps verifying; a request that starts quoting its
prompt speculates again within MAX_RETRY_STEPS steps.
"""
from __future__ import annotations

from dataclasses import dataclass

FIXED_COST = 3.3       # a step's cost beyond its rows, in decode rows
MIXED_COST = 2.0       # extra cost of a step with a multi-token request, in decode rows
Q_PRIOR = 0.9          # acceptance rate a new request is assumed to have
Q_PROBE = 0.6          # ... and one given a fresh chance after a pause
DECAY = 0.8            # weight of the past per verify step in the acceptance rate
PRIOR_WEIGHT = 2.0     # decided drafts the prior counts as
RETRY_STEPS = 32
MAX_RETRY_STEPS = 256


def draft_threshold(num_decoding: int) -> float:
    """The least chance a draft must have of being accepted to be worth its row."""
    return num_decoding / (FIXED_COST + num_decoding)


def step_pays(expected_accepted: float, num_drafts: int, num_decoding: int) -> bool:
    return expected_accepted * (FIXED_COST + num_decoding) > num_decoding * (MIXED_COST + num_drafts)


@dataclass
class AcceptanceGate:
    accepted: float = Q_PRIOR * PRIOR_WEIGHT   # decayed count of accepted drafts
    decided: float = PRIOR_WEIGHT              # decayed count of decided drafts
    idle: int = 0                              # decode steps since the last verify step
    retry: int = RETRY_STEPS

    @property
    def acceptance(self) -> float:
        return self.accepted / self.decided

    def num_drafts(self, limit: int, threshold: float) -> int:
        """Drafts worth trying now (at most `limit`): the m-th while q^m clears `threshold`."""
        self.idle += 1
        if self.idle > self.retry:  # a pause long enough: give it a fresh chance
            self.accepted, self.decided = Q_PROBE * PRIOR_WEIGHT, PRIOR_WEIGHT
            self.idle = 0
            self.retry = min(2 * self.retry, MAX_RETRY_STEPS)
        q, count, chance = self.acceptance, 0, 1.0
        while count < limit and chance * q > threshold:
            chance *= q
            count += 1
        return count

    def expected_accepted(self, num_drafts: int) -> float:
        q = self.acceptance
        return sum(q ** m for m in range(1, num_drafts + 1))

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.accepted = DECAY * self.accepted + num_accepted
        self.decided = DECAY * self.decided + num_accepted + (num_accepted < num_drafts)
        self.idle = 0
        if num_accepted > 0:
            self.retry = RETRY_STEPS
