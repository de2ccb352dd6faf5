"""Turns a SchedulerOutput into the step's tensors, in persistent buffers.

Safety rule (docs/design.md): every position past the real tokens -- the *whole*
rest of the slot buffer, not just up to the padded count -- is refilled with
PAD_SLOT_ID each step, and every block-table row past the real requests is
zeroed with length 0. A dummy batch is the degenerate case: no real tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.ops.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.paging import NULL_BLOCK_ID, PAD_SLOT_ID, slots_for_positions
from engine.request import SchedulerOutput


@dataclass
class StepBatch:
    input_ids: torch.Tensor        # [num_padded_tokens]
    positions: torch.Tensor        # [num_padded_tokens]
    meta: AttentionMetadata
    logits_indices: list[int]      # per scheduled request: the token whose logits sample (or -1);
                                   # with drafts, the first of its 1 + len(drafts) verified rows

    @property
    def is_dummy(self) -> bool:
        return self.meta.num_reqs == 0


class BatchBuilder:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.block_size = config.block_size
        # Persistent CPU buffers; the step views prefixes of them.
        max_tokens = config.padded_num_tokens(config.max_num_batched_tokens)
        self.max_tokens = max_tokens
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64)
        self.slot_mapping = torch.full((max_tokens,), PAD_SLOT_ID, dtype=torch.int64)
        self.block_tables = torch.zeros(config.max_num_seqs, config.max_blocks_per_seq, dtype=torch.int32)
        self.seq_lens = torch.zeros(config.max_num_seqs, dtype=torch.int64)
        self.query_start_loc = torch.zeros(config.max_num_seqs + 1, dtype=torch.int64)
        self._np_ids, self._np_pos, self._np_slots = self.input_ids.numpy(), self.positions.numpy(), self.slot_mapping.numpy()
        self._np_tables = self.block_tables.numpy()
        self._np_seq_lens, self._np_starts = self.seq_lens.numpy(), self.query_start_loc.numpy()
        # On CPU the step reads these buffers themselves: no .to(device) per tensor and step.
        self._on_cpu = torch.device(config.device).type == "cpu"
        self._generator = torch.Generator().manual_seed(config.seed + config.parallel.data_parallel_rank)

    def build(self, sched: SchedulerOutput, num_padded: int | None = None) -> StepBatch:
        num_reqs, num_tokens = sched.num_reqs, sched.num_tokens
        if num_padded is None:
            num_padded = self.config.padded_num_tokens(num_tokens)
        assert num_tokens <= num_padded <= self.max_tokens
        bs = self.block_size
        starts, seq_lens, logits_indices = [0], [], []
        offset = 0
        spec = sched.spec_token_ids
        for row, (request, num_new) in enumerate(sched.scheduled):
            start = request.num_computed_tokens
            end = start + num_new
            block_ids = request.block_ids
            # Speculative decoding: the last len(drafts) scheduled tokens are proposals past the
            # request's tokens; the logits of its last token and of every draft are verified.
            drafts = spec.get(request.key, ()) if spec else ()
            num_known = num_new - len(drafts)
            if num_new == 1 and num_known == 1:  # a decode row: scalars, not arrays (~2 us, not ~10)
                self._np_ids[offset] = request.all_token_ids[start]
                self._np_pos[offset] = start
                self._np_slots[offset] = slots_for_positions(block_ids, start, bs)
            else:
                positions = np.arange(start, end)
                self._np_ids[offset:offset + num_known] = request.all_token_ids[start:start + num_known]
                self._np_ids[offset + num_known:offset + num_new] = drafts
                self._np_pos[offset:offset + num_new] = positions
                self._np_slots[offset:offset + num_new] = slots_for_positions(
                    np.asarray(block_ids, dtype=np.int64), positions, bs)
            table = self._np_tables[row]
            table[:len(block_ids)] = block_ids
            table[len(block_ids):] = NULL_BLOCK_ID
            offset += num_new
            starts.append(offset)
            seq_lens.append(end)
            logits_indices.append(offset - 1 - len(drafts) if start + num_known == request.num_tokens else -1)
        # Padding: the whole remainder of every buffer, so nothing stale survives.
        self._np_ids[num_tokens:] = 0
        self._np_pos[num_tokens:] = 0
        self._np_slots[num_tokens:] = PAD_SLOT_ID
        self._np_tables[num_reqs:] = NULL_BLOCK_ID
        self._np_seq_lens[:num_reqs] = seq_lens
        self._np_seq_lens[num_reqs:] = 0
        self._np_starts[:num_reqs + 1] = starts
        self._np_starts[num_reqs + 1:] = num_tokens
        return self._batch(num_reqs, num_tokens, num_padded, starts, seq_lens, logits_indices)

    def build_dummy(self, num_padded: int) -> StepBatch:
        """A batch of `num_padded` tokens that writes nothing: all slots PAD_SLOT_ID, tables 0."""
        assert 1 <= num_padded <= self.max_tokens
        if self.config.parallel.dummy_batch_random_inputs:
            self.input_ids[:num_padded].random_(0, self.config.model.vocab_size, generator=self._generator)
        else:
            self._np_ids[:] = 0
        self._np_pos[:] = 0
        self._np_slots[:] = PAD_SLOT_ID
        self._np_tables[:] = NULL_BLOCK_ID
        self.seq_lens.zero_()
        self.query_start_loc.zero_()
        return self._batch(0, 0, num_padded, [0], [], [])

    def _batch(self, num_reqs: int, num_tokens: int, num_padded: int, starts: list[int],
               seq_lens: list[int], logits_indices: list[int]) -> StepBatch:
        to = self._on_device
        meta = AttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_tokens, num_padded_tokens=num_padded,
            slot_mapping=to(self.slot_mapping[:num_padded]),
            query_start_loc=to(self.query_start_loc[:num_reqs + 1]),
            seq_lens=to(self.seq_lens[:num_reqs]),
            block_tables=to(self.block_tables[:max(num_reqs, 1)]),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
            max_seq_len=max(seq_lens, default=0))
        return StepBatch(input_ids=to(self.input_ids[:num_padded]), positions=to(self.positions[:num_padded]),
                         meta=meta, logits_indices=logits_indices)

    def _on_device(self, buffer: torch.Tensor) -> torch.Tensor:
        """A buffer's view as the step reads it: itself on CPU, else copied to the device."""
        return buffer if self._on_cpu else buffer.to(self.config.device, non_blocking=True)
