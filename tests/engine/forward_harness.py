"""Test helper: drive a model through the paged KV cache by hand, and get reference
logits from transformers for the same checkpoint.

`PagedRunner` plays scheduler + batch builder in miniature: each request gets its
own blocks (block 0, the null block, is never handed out), slots come from the
block table, padded tokens carry PAD_SLOT_ID and padded table columns point at 0.
A step may run on NaN activations (a forward hook on the embedding), as a dummy batch
built from garbage buffers would.
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from engine.ops.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.paging import PAD_SLOT_ID
from engine.worker.kv_cache import allocate_kv_cache
from engine.worker.loader import load_model
from engine.models.layers import StepContext
from tests.engine.cache_probe import nan_embeddings


def engine_config(path: str | Path, **kwargs) -> EngineConfig:
    args = dict(num_gpu_blocks=96, block_size=4, max_model_len=256)
    args.update(kwargs)
    return EngineConfig.create(str(path), **{"dtype": "float32", **args})


class PagedRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None):
        self.config = config
        self.model = model if model is not None else load_model(config)
        self.caches = allocate_kv_cache(config)
        self.null_block_writes = torch.zeros(1, dtype=torch.int64)
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}
        self._next_block = 1  # block 0 is the null block

    @torch.inference_mode()
    def step(self, batch: dict[str, list[int]], pad_to: int = 0,
             nan_activations: bool = False) -> dict[str, torch.Tensor]:
        """Run one step: each request's new tokens, then padding up to `pad_to` tokens
        (an empty `batch` is a dummy batch). Returns each request's logits [num_new, vocab]."""
        bs = self.config.block_size
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for key, new in batch.items():
            start = self.lengths.get(key, 0)
            end = start + len(new)
            table = self.tables.setdefault(key, [])
            while len(table) * bs < end:
                table.append(self._next_block)
                self._next_block += 1
            assert self._next_block <= self.config.num_blocks, "test ran out of KV blocks"
            for pos, token in zip(range(start, end), new):
                ids.append(token)
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            self.lengths[key] = end
            starts.append(len(ids))
            seq_lens.append(end)
        num_tokens = len(ids)
        num_padded = max(pad_to, num_tokens)
        pad = num_padded - num_tokens
        ids += [0] * pad
        positions += [0] * pad
        slots += [PAD_SLOT_ID] * pad
        tables = torch.zeros(max(len(batch), 1), self.config.max_blocks_per_seq, dtype=torch.int32)
        for row, key in enumerate(batch):
            tables[row, :len(self.tables[key])] = torch.tensor(self.tables[key], dtype=torch.int32)
        meta = AttentionMetadata(
            num_reqs=len(batch), num_tokens=num_tokens, num_padded_tokens=num_padded,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=tables, query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
            max_seq_len=max(seq_lens, default=0))
        ctx = StepContext(meta=meta, kv_caches=self.caches, null_block_writes=self.null_block_writes)
        with nan_embeddings(self.model) if nan_activations else contextlib.nullcontext():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)  # [num_padded, hidden]
        assert hidden.shape[0] == num_padded
        logits = self.model.compute_logits(hidden[:num_tokens])
        return {key: logits[starts[i]:starts[i + 1]] for i, key in enumerate(batch)}

    def null_block_is_zero(self) -> bool:
        return all(bool((t[0] == 0).all()) for entry in self.caches
                   for t in (entry if isinstance(entry, tuple) else (entry,)))

    def run_sequence(self, key: str, tokens: list[int], prompt_len: int, pad_to: int = 0) -> torch.Tensor:
        """Prefill tokens[:prompt_len], then decode the rest one at a time (teacher-forced).
        Returns logits for every position [len(tokens), vocab]."""
        out = [self.step({key: tokens[:prompt_len]}, pad_to)[key]]
        for pos in range(prompt_len, len(tokens)):
            out.append(self.step({key: [tokens[pos]]}, pad_to)[key])
        return torch.cat(out)


@functools.lru_cache(maxsize=16)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
    return model.eval()


@torch.inference_mode()
def hf_logits(path: str | Path, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for one full sequence, [len(tokens), vocab]."""
    return _hf_model(str(path))(torch.tensor([tokens])).logits[0]


def random_tokens(count: int, vocab_size: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab_size, (count,), generator=gen).tolist()
