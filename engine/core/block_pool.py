"""Fixed pool of KV blocks: reference counts, a prefix cache, LRU eviction.

Block 0 is the null block: it is never handed out, never freed and never
cached. Unused block-table entries and padded rows point at it, so it must
stay bitwise zero (the sentinel watches it).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

from engine.paging import FIRST_USABLE_BLOCK_ID, NULL_BLOCK_ID


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained content hash of one full block: equal hashes mean equal whole prefixes."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(len(token_ids).to_bytes(4, "little"))
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return digest.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("num_blocks: need at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Free blocks in eviction order (oldest first); cached-but-free blocks stay reusable
        # until they are evicted from the front.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(FIRST_USABLE_BLOCK_ID, num_blocks))
        self.cached: dict[bytes, int] = {}
        # Blocks whose contents stopped being read-only since the last take_unsealed(): handed
        # out again (about to be rewritten) or freed with no cached copy (nobody reads them).
        self.unsealed: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_queue):
            raise RuntimeError(f"cannot allocate {count} blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            self._uncache(block_id)
            self.ref_counts[block_id] = 1
            self.unsealed.append(block_id)
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks a new request reuses."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        # Reverse order: a request's tail blocks are the least likely to be shared,
        # so they reach the front of the eviction queue first.
        for block_id in reversed(block_ids):
            assert block_id != NULL_BLOCK_ID, "the null block is never owned"
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
                if self.block_hash[block_id] is None:
                    self.unsealed.append(block_id)

    def cache(self, block_id: int, block_hash: bytes) -> None:
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self.cached:  # the same content already lives in another block
            return
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def take_unsealed(self) -> list[int]:
        blocks, self.unsealed = self.unsealed, []
        return blocks

    def drop_from_cache(self, block_id: int) -> None:
        """Forget a block's contents (a poisoned block must never be reused by a prefix hit)."""
        self._uncache(block_id)

    def _uncache(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            self.block_hash[block_id] = None
            if self.cached.get(block_hash) == block_id:
                del self.cached[block_hash]
