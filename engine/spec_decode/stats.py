"""A rank's speculative decoding counters (monotonic since start-up), sent in StepStats and
exported by service/metrics.py with vLLM's names."""
from __future__ import annotations

import msgspec


class SpecDecodeStats(msgspec.Struct, array_like=True):
    num_drafts: int = 0            # verify steps of a request (a request with drafts in a step)
    num_draft_tokens: int = 0      # draft tokens proposed and verified
    num_accepted_tokens: int = 0   # of which accepted
    num_emitted_tokens: int = 0    # tokens the verify steps emitted (accepted + one each)
    accepted_per_pos: list[int] = msgspec.field(default_factory=list)  # [k] accepted at draft position i

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """Tokens a verify step emits on average (1 = nothing gained)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               self.num_emitted_tokens, list(self.accepted_per_pos))
