"""Prompt lookup: the tokens that followed the latest earlier occurrence of the request's own
suffix n-gram (prompt + output), trying the longest n-gram first.

Extraction, editing and summarising answers quote their prompt, so once the output starts
quoting, the suffix matches the prompt and the continuation is proposed; free text rarely
matches an n-gram of useful length, and then nothing is proposed (the step stays a plain decode).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n:]
            # Windows starting at 0 .. num_tokens - n - 1: every earlier n-gram (not the suffix itself).
            windows = sliding_window_view(tokens[:num_tokens - 1], n)  # [num_tokens - n, n]
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts):
                follow = starts[-1] + n  # the latest match: nearest context, longest continuation is capped anyway
                return tokens[follow:follow + limit].tolist()
        return []
