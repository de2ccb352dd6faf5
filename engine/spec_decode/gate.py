"""When a request proposes: a verify step whose drafts are all rejected costs more than a plain
decode (k more query tokens, the multi-token attention path, no decode CUDA graph) and gains
nothing, so a request whose drafts keep failing stops proposing for a while.

Rule: after a verify step that accepted no draft, the request skips its next `backoff` chances
to propose, with `backoff` doubling (1, 2, 4 ... MAX_BACKOFF) on every further all-rejected step;
a step that accepted at least one draft (it emitted two tokens or more for one forward) resets
it. Free text, where n-gram matches are rare and mostly wrong, thus speculates on a vanishing
share of its steps; a request that starts quoting its prompt speculates again within
MAX_BACKOFF steps.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_BACKOFF = 32  # decode steps a failing request waits, at most, before it tries again


@dataclass
class AcceptanceGate:
    backoff: int = 0    # steps skipped after the next all-rejected verify step / 2
    skip: int = 0       # proposal chances still to skip

    def may_propose(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        if num_accepted == 0:
            self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF)
            self.skip = self.backoff
        else:
            self.backoff = 0
            self.skip = 0
