"""Speculative decoding by prompt lookup (n-gram): a request's own prompt and output propose the
next tokens (proposer.py), the target model scores them in one forward, and rejection sampling
keeps the output distribution exact (rejection_sampler.py). gate.py turns proposals off for a
request whose recent drafts were rejected; stats.py counts drafts and acceptances per rank.

The scheduler only reads `Request.draft_token_ids`; the engine core fills it (speculator.py)
and rolls a request's KV bookkeeping back to the accepted length (docs/design.md).
"""
