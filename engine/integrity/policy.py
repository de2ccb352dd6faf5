"""What a finding in the KV cache triggers (--nan-policy): count it, heal, or fail the rank.

- count: the metrics show it; nothing else changes.
- heal: every request reading a poisoned or mismatching block ends with "error", the block
  leaves the prefix cache and is zeroed (block 0 is zeroed in place); a request whose logits
  are not finite ends with "error".
- fail: as count, and the rank reports itself tripped, so the front end's /ready turns 503
  (the pod leaves the load balancer; an operator looks at it); non-finite logits end their
  request with "error".
"""
from __future__ import annotations

import enum


class NaNPolicy(enum.StrEnum):
    COUNT = "count"
    HEAL = "heal"
    FAIL = "fail"

    @property
    def heals(self) -> bool:
        return self is NaNPolicy.HEAL

    @property
    def trips(self) -> bool:
        return self is NaNPolicy.FAIL

    @property
    def ends_requests_on_bad_logits(self) -> bool:
        return self is not NaNPolicy.COUNT
