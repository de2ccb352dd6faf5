"""Paged attention over the block-table KV cache (torch, any device).

Reads K/V through each request's block table, the way real kernels do:
unused table entries point at the null block (block 0) and positions past a
sequence's length are masked with a zero weight *after* being read. So a NaN
planted in block 0 propagates (0 x NaN = NaN) -- deliberately: the sentinel,
not the attention, is what guards the null block.

This module holds the step's metadata, the plans and the torch references; which path a step
takes (a csrc/ kernel, FlexAttention, or these references) is an attention backend's choice,
made once per model load (engine/ops/attention_backends.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F



@dataclass
class AttentionMetadata:
    """Per-step inputs every attention layer reads; built by the batch builder."""
    num_reqs: int                    # real requests in the step (0 for a dummy batch)
    num_tokens: int                  # real tokens in the step
    num_padded_tokens: int           # tokens the model runs on (>= num_tokens)
    slot_mapping: torch.Tensor       # [num_padded_tokens] int64, PAD_SLOT_ID past the real tokens
    query_start_loc: torch.Tensor    # [num_reqs + 1] int64 offsets of each request's query tokens
    seq_lens: torch.Tensor           # [num_reqs] int64 KV length after this step's tokens
    block_tables: torch.Tensor       # [num_reqs, max_blocks_per_req] int32, 0 = null block
    query_start_loc_cpu: list[int]   # same as query_start_loc, as Python ints
    seq_lens_cpu: list[int]
    max_seq_len: int
    # Leading requests with exactly one query token (the scheduler puts them first): they
    # attend in one batched call, only the rest (prefill chunks) one by one.
    num_decodes: int | None = None
    # Device-only metadata of a fixed shape (a CUDA-graph decode step, engine/worker/cuda_graphs.py):
    # every row is one query token, of a request or of padding (length 0, table row all null
    # block); the host-side lists are not filled, since a captured graph could not read them.
    fixed_shape: bool = False

    def __post_init__(self) -> None:
        if self.fixed_shape:
            self.num_decodes = self.num_reqs
        elif self.num_decodes is None:
            starts, count = self.query_start_loc_cpu, 0
            while count < self.num_reqs and starts[count + 1] - starts[count] == 1:
                count += 1
            self.num_decodes = count

    _decode_plan: DecodePlan | None = field(default=None, repr=False)
    _prefill_plan: PrefillPlan | None = field(default=None, repr=False)

    @classmethod
    def fixed_decode(cls,
                     slot_mapping: torch.Tensor,     # [S] int64, PAD_SLOT_ID on padded rows
                     query_start_loc: torch.Tensor,  # [S + 1] int64, 0..S
                     seq_lens: torch.Tensor,         # [S] int64, 0 on padded rows
                     block_tables: torch.Tensor,     # [S, max_blocks_per_req] int32
                     ) -> AttentionMetadata:
        """S one-token rows whose lengths and tables are read on the device only."""
        size = slot_mapping.shape[0]
        return cls(num_reqs=size, num_tokens=size, num_padded_tokens=size, slot_mapping=slot_mapping,
                   query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
                   query_start_loc_cpu=[], seq_lens_cpu=[], max_seq_len=0, fixed_shape=True)

    @property
    def max_decode_seq_len(self) -> int:
        return max(self.seq_lens_cpu[:self.num_decodes], default=0)

    def decode_plan(self, block_size: int, device: torch.device) -> DecodePlan:
        """How many table entries each decode row reads; computed once per step."""
        if self._decode_plan is None:
            self._decode_plan = plan_decode_reads(self.seq_lens_cpu[:self.num_decodes], block_size, device)
        return self._decode_plan

    def prefill_plan(self, block_size: int, device: torch.device) -> PrefillPlan:
        """The prefill tokens as one-query rows (for the CPU kernel); computed once per step."""
        if self._prefill_plan is None:
            self._prefill_plan = plan_prefill_rows(self, block_size, device)
        return self._prefill_plan


# A row shares its group's padded length when that costs at most half its group's longest,
# or at most this many blocks (reading padding from the null block is cheap: it is cached).
PAD_SLACK_BLOCKS = 4


@dataclass
class DecodePlan:
    """Decode rows grouped by similar length. Every row reads as many table entries as
    the longest row of its group, the entries past its own blocks being the null block:
    padding, read with weight zero, as real kernels read it. Grouping only bounds how much
    padding a short request reads next to a long one; it never removes it."""
    reads: torch.Tensor                       # [B] int32 table entries row b reads
    num_read: int                             # the most any row reads
    groups: list[tuple[list[int], int]]       # (rows, entries they read)

    @functools.cached_property
    def group_rows(self) -> list[tuple[torch.Tensor, int]]:
        """The groups' rows as index tensors, for the torch path: built once per step, on
        first use (the CPU kernel reads `reads` and never needs them)."""
        return [(torch.tensor(rows, dtype=torch.int64, device=self.reads.device), n) for rows, n in self.groups]


@dataclass
class PrefillPlan:
    """Causal prefill as one-query rows: the token at position p of a request attends to
    positions [0, p] of that request, which is decode attention with seq_len = p + 1 over
    the request's block-table row. Rows read only their own request's blocks."""
    tables: torch.Tensor    # [T, num_read] int32, each prefill token's request's table row
    seq_lens: torch.Tensor  # [T] int64 position + 1
    reads: torch.Tensor     # [T] int32 table entries each row reads
    num_read: int


def plan_prefill_rows(meta: AttentionMetadata, block_size: int, device: torch.device) -> PrefillPlan:
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    first = meta.num_decodes
    counts = [starts[i + 1] - starts[i] for i in range(first, meta.num_reqs)]
    owner = torch.repeat_interleave(torch.arange(first, meta.num_reqs), torch.tensor(counts))
    seq_lens = torch.cat([torch.arange(lens[i] - n + 1, lens[i] + 1) for i, n in zip(range(first, meta.num_reqs),
                                                                                       counts)])
    num_read = max(-(-lens[i] // block_size) for i in range(first, meta.num_reqs))
    tables = meta.block_tables.index_select(0, owner.to(meta.block_tables.device))[:, :num_read].contiguous()
    return PrefillPlan(tables=tables, seq_lens=seq_lens.to(device),
                       reads=((seq_lens + block_size - 1) // block_size).to(torch.int32).to(device),
                       num_read=num_read)


def plan_decode_reads(seq_lens: list[int], block_size: int, device: torch.device) -> DecodePlan:
    blocks = [-(-n // block_size) for n in seq_lens]
    order = sorted(range(len(blocks)), key=lambda i: -blocks[i])
    reads = [0] * len(blocks)
    groups: list[tuple[list[int], int]] = []
    for i in order:
        if groups and groups[-1][1] - blocks[i] <= max(groups[-1][1] // 2, PAD_SLACK_BLOCKS):
            groups[-1][0].append(i)
        else:
            groups.append(([i], blocks[i]))
        reads[i] = groups[-1][1]
    return DecodePlan(reads=torch.tensor(reads, dtype=torch.int32, device=device),
                      num_read=max(blocks, default=0),
                      groups=groups)


def gather_kv(cache: torch.Tensor,         # [num_blocks, block_size, *rest]
              block_tables: torch.Tensor,  # [num_reqs, num_blocks_read]
              ) -> torch.Tensor:           # [num_reqs, num_blocks_read * block_size, *rest]
    num_reqs, num_read = block_tables.shape
    gathered = cache.index_select(0, block_tables.reshape(-1).long())
    return gathered.view(num_reqs, num_read * cache.shape[1], *cache.shape[2:])


def attend(q: torch.Tensor,      # [B, Hq, Lq, D]
            k: torch.Tensor,      # [B, Hkv, Lk, D]
            v: torch.Tensor,      # [B, Hkv, Lk, Dv]
            allowed: torch.Tensor | None,  # [B, 1, Lq, Lk] bool, None = causal from the start
            scale: float) -> torch.Tensor:  # [B, Hq, Lq, Dv]
    gqa = q.shape[1] != k.shape[1]
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def gather_heads(cache: torch.Tensor,         # [num_blocks, block_size, Hkv, D], any layout
                 block_tables: torch.Tensor,  # [B, num_blocks_read]
                 ) -> torch.Tensor:           # [Hkv, B, num_blocks_read * block_size, D], contiguous
    batch, num_read = block_tables.shape
    physical = cache.permute(2, 0, 1, 3)  # [Hkv, NB, bs, D]: contiguous for the head-major CPU layout
    gathered = physical.index_select(1, block_tables.reshape(-1).long())
    return gathered.reshape(cache.shape[2], batch, num_read * cache.shape[1], cache.shape[3])


def _decode_attend(q: torch.Tensor,        # [B, Hq, D]
                   k: torch.Tensor,        # [Hkv, B, L, D]
                   v: torch.Tensor,        # [Hkv, B, L, Dv]
                   allowed: torch.Tensor,  # [B, L] bool
                   scale: float) -> torch.Tensor:  # [B, Hq, Dv]
    """One query per request: the query heads sharing a KV head form the rows of one small
    matmul (no K/V expansion for GQA); ~1.4x faster than SDPA's flash kernel for q_len 1 on
    CPU. Masked scores become -inf after the read, so a NaN read from padding still spreads
    through the value product, exactly as in real kernels."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * scale          # [Hkv, B, G, L]
    scores = scores.masked_fill(~allowed[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)                                                  # [Hkv, B, G, Dv]
    return out.transpose(0, 1).reshape(batch, num_heads, v.shape[-1])


def decode_attention_reference(query: torch.Tensor,        # [B, Hq, D]
                               key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D]
                               value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
                               tables: torch.Tensor,       # [B, >= plan.num_read]
                               seq_lens: torch.Tensor,     # [B] int64
                               plan: DecodePlan,
                               scale: float) -> torch.Tensor:  # [B, Hq, Dv]
    """One query token per request, each group of rows over its longest row's table entries
    (the torch reference of csrc/cpu/cpu_attention.cpp and of engine/ops/flex_attention.py)."""
    out = query.new_empty(query.shape[0], query.shape[1], value_cache.shape[-1])
    for rows, num_read in plan.group_rows:
        group_tables = tables.index_select(0, rows)[:, :num_read]
        positions = torch.arange(num_read * key_cache.shape[1], device=query.device)
        allowed = positions[None, :] < seq_lens.index_select(0, rows)[:, None]  # [n, L]
        out[rows] = _decode_attend(query.index_select(0, rows), gather_heads(key_cache, group_tables),
                                   gather_heads(value_cache, group_tables), allowed, scale)
    return out


def prefill_attention_reference(out: torch.Tensor,          # [num_padded_tokens, Hq, Dv], rows written
                                query: torch.Tensor,        # [num_padded_tokens, Hq, D]
                                key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D]
                                value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
                                meta: AttentionMetadata,
                                scale: float) -> None:
    """Each prefill chunk (the requests past the decodes) causally over its cached sequence,
    through SDPA one request at a time: the torch reference of csrc/cpu/cpu_prefill_attention.cpp,
    and what every backend runs for chunks its kernels do not take."""
    starts, lens, block_size = meta.query_start_loc_cpu, meta.seq_lens_cpu, key_cache.shape[1]
    decodes = meta.num_decodes
    for i in range(decodes, meta.num_reqs):
        q_start, q_end, seq_len = starts[i], starts[i + 1], lens[i]
        num_new = q_end - q_start
        num_read = -(-seq_len // block_size)
        table = meta.block_tables[i:i + 1, :num_read]
        k = gather_kv(key_cache, table).transpose(1, 2)  # [1, Hkv, L, D]
        v = gather_kv(value_cache, table).transpose(1, 2)
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if num_new == seq_len:  # nothing cached before this chunk: plain causal
            k, v, allowed = k[:, :, :seq_len], v[:, :, :seq_len], None
        else:
            q_pos = torch.arange(seq_len - num_new, seq_len, device=query.device)
            k_pos = torch.arange(k.shape[2], device=query.device)
            allowed = (k_pos[None, :] <= q_pos[:, None]).view(1, 1, num_new, -1)
        out[q_start:q_end] = attend(q, k, v, allowed, scale)[0].transpose(0, 1)
