"""Per-request block bookkeeping on top of the block pool."""
from __future__ import annotations

from engine.core.block_pool import BlockPool, hash_block
from engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0   # prompt tokens looked up
        self.prefix_hits = 0      # of which found in the cache

    def _full_block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Leading blocks of the request's tokens already in the prefix cache.

        At least one token is always left to compute, so the step produces logits.
        """
        if not self.enable_prefix_caching:
            return []
        num_lookup = request.num_tokens - 1
        hits: list[int] = []
        for block_hash in self._full_block_hashes(request, num_lookup):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry while it waits)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if the pool is short."""
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(request.block_ids) - len(computed_blocks)
        reusable_free = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if needed > self.pool.num_free_blocks - reusable_free:
            return False
        if computed_blocks:
            self.pool.touch(list(computed_blocks))
            request.block_ids.extend(computed_blocks)
            request.num_computed_tokens += len(computed_blocks) * self.block_size
            request.num_hashed_blocks = len(request.block_ids)
        if needed > 0:
            request.block_ids.extend(self.pool.allocate(needed))
        return True

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """New blocks `num_new_tokens` more computed tokens take."""
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def trim(self, request: Request) -> None:
        """Speculative decoding's rollback: free the blocks past the request's tokens (lookahead
        blocks that only rejected drafts wrote). Their slots were never computed tokens: the
        blocks carry no hash and no seal, and the pool lists them as unsealed."""
        keep = -(-request.num_tokens // self.block_size)
        if len(request.block_ids) > keep:
            self.pool.free(request.block_ids[keep:])
            del request.block_ids[keep:]

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_hashed_blocks:
            return
        hashes = self._full_block_hashes(request, num_full * self.block_size)
        for i in range(request.num_hashed_blocks, num_full):
            self.pool.cache(request.block_ids[i], hashes[i])
        request.num_hashed_blocks = num_full

    def free(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_hashed_blocks = 0
