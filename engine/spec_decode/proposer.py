"""Prompt lookup: the tokens that followed the latest earlier occurrence of the request's own
suffix n-gram (prompt + output), trying the longest n-gram first.

Extraction, editing and summarising answers quote their prompt, so once the output starts
quoting, the suffix matches the prompt and the continuation is proposed; free text rarely
matches an n-gram of useful length, and then nothing is proposed (the step stays a plain decode).
"""
from __future__ import annotations

import numpy as np

from engine.spec_decode.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int] | np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) tokens that followed the latest earlier match of the longest
        suffix n-gram (n from prompt_lookup_max down to prompt_lookup_min); [] when none matches."""
        limit = self.k if max_drafts is None else min(self.k, max_drafts)
        tokens = np.asarray(token_ids, dtype=np.int64)  # [num_tokens]
        num_tokens = len(tokens)
        if limit <= 0 or num_tokens <= self.min_n:
            return []
        # Candidates: earlier positions holding the last token; each n-gram only narrows them.
        ends = np.flatnonzero(tokens[:num_tokens - 1] == tokens[-1])  # [candidates] match ends
        matched = 1
        for n in range(2, min(self.max_n, num_tokens - 1) + 1):
            ends_n = ends[ends >= n - 1]
            ends_n = ends_n[tokens[ends_n - (n - 1)] == tokens[num_tokens - n]]
            if len(ends_n) == 0:
                break
            ends, matched = ends_n, n
        if len(ends) == 0 or matched < self.min_n:
            return []
        follow = int(ends[-1]) + 1  # the latest match of the longest n-gram
        return tokens[follow:follow + limit].tolist()
