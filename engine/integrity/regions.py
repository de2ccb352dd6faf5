"""Where in the KV cache a finding lies: the labels of the integrity metrics."""
from __future__ import annotations

import enum


class Region(enum.StrEnum):
    NULL_BLOCK = "null_block"      # block 0: never handed out, must stay zero
    ALLOCATED = "allocated"        # every other block (the NaN sentinel's split)
    PREFIX_CACHE = "prefix_cache"  # a sealed block cached for reuse (the checksums' split)
    RUNNING = "running"            # a sealed block that only running requests read


NAN_REGIONS = (Region.NULL_BLOCK, Region.ALLOCATED)
CHECKSUM_REGIONS = (Region.PREFIX_CACHE, Region.RUNNING)
