"""Runs one step of the model over the paged cache and samples."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.ops import attention_backends, cpu_ops
from engine.ops.implementations import graphs_entry, op_implementations
from engine.models.cpu_gemm import linear_paths
from engine.integrity.write_guard import WriteGuard
from engine.worker.batch_builder import BatchBuilder, StepBatch
from engine.worker.cuda_graphs import DecodeGraphs, eager_reason
from engine.config import EngineConfig
from engine.worker.kv_cache import allocate_kv_storage, layer_views
from engine.worker.loader import load_model
from engine.messages import TokenLogprob
from engine.models.layers import StepContext
from engine.worker.sampler import Sampler, token_logprobs
from engine.request import Request, SchedulerOutput

log = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    written_slots: torch.Tensor  # [num_tokens] int64: the cache slots this step wrote (its real tokens)
    sampled: dict[str, int] = field(default_factory=dict)                 # request key -> token
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    nan_logits: set[str] = field(default_factory=set)                      # request keys
    # Speculative decoding: request key -> the tokens its verify step emits (accepted drafts,
    # then the model's own); `sampled` holds the first of them.
    spec_runs: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model = load_model(config)
        self.kv_storage = allocate_kv_storage(config)   # every layer in one tensor (see kv_cache.py)
        self.kv_caches = layer_views(self.kv_storage, config)
        self.builder = BatchBuilder(config)
        self.sampler = Sampler(config.seed)
        # Device-side count of cache writes whose slot fell in the null block.
        self.null_block_writes = torch.zeros(1, dtype=torch.int64, device=config.device)
        self.write_guard = WriteGuard(config.num_blocks, config.block_size, config.device, config.strict_kv_writes)
        if torch.device(config.device).type == "cpu":
            cpu_ops.available()  # build (or load) the CPU attention kernel now, not inside a step
        # The attention path of every step, chosen once (the CUDA graphs' fixed-shape steps
        # take FlexAttention whole: eager_reason asks this same choice).
        self.attention = attention_backends.select(config.device, config.model.dtype, self.kv_storage.dtype)
        # Pure-decode steps (and dummy batches) up to the largest size replay CUDA graphs.
        self.graphs: DecodeGraphs | None = None
        reason = eager_reason(config)
        if reason is None:
            self.graphs = DecodeGraphs(config, self.model, self.kv_storage, self.kv_caches,
                                       self.null_block_writes, self.write_guard)
            with torch.inference_mode():
                self.graphs.capture()  # raises, naming the layers, if capture dirtied the null block
        elif config.device.startswith("cuda"):
            # The operator's choice is news; anything else is a fallback, and slower.
            level = logging.INFO if reason == "--enforce-eager" else logging.WARNING
            log.log(level, "decode steps run eagerly, without CUDA graphs: %s", reason)
        self.graphs_reason = reason

    def implementations(self) -> dict[str, str]:
        """What this rank runs (engine/ops/implementations.py): every registry op's kernel or
        fallback, the GEMM path of each linear kind, the layer stack, and CUDA graphs on or off."""
        # Whether this model's layers run as the fused stack (the decoder_layers op), or as the
        # Python loop (--enforce-eager, a model that is not a plain dense decoder, no kernel).
        stack = getattr(getattr(self.model, "model", None), "fused", None)
        return {**op_implementations(self.config.device), **linear_paths(self.model),
                "layer_stack": "fused_stack" if stack is not None else "python_loop",
                "cuda_graphs": graphs_entry(self.graphs_reason)}

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:  # [num_padded_tokens, hidden]
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        ctx = StepContext(meta=batch.meta, kv_caches=self.kv_caches, null_block_writes=self.null_block_writes,
                          write_guard=self.write_guard, attention=self.attention)
        return self.model(batch.input_ids, batch.positions, ctx)

    def run_dummy(self, num_padded: int) -> torch.Tensor:  # [num_padded] int64
        """Step a dummy batch; returns the slot mapping it ran with (all PAD_SLOT_ID: no writes)."""
        batch = self.builder.build_dummy(num_padded)
        self.write_guard.begin_step([])  # a dummy batch owns no block
        self.forward(batch)
        if self.graphs is not None and self.config.cuda_graph_check_null_block:
            self.graphs.check_null_block("a dummy batch")  # debug: one host sync per dummy batch
        return batch.meta.slot_mapping

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, num_padded: int | None = None) -> RunnerOutput:
        batch = self.builder.build(sched, num_padded)
        self.write_guard.begin_step(writable_blocks(sched, self.config.block_size))
        hidden = self.forward(batch)
        out = RunnerOutput(written_slots=batch.meta.slot_mapping[:batch.meta.num_tokens])
        requests = [r for r, _ in sched.scheduled]
        sample_rows = [i for i, idx in enumerate(batch.logits_indices) if idx >= 0]
        drafts_of = sched.spec_token_ids
        verify_rows = [i for i in sample_rows if requests[i].key in drafts_of]
        sample_rows = [i for i in sample_rows if requests[i].key not in drafts_of]
        if sample_rows or verify_rows:
            # One lm_head pass: the sampling rows, then each verifying request's 1 + k rows.
            rows = [batch.logits_indices[i] for i in sample_rows]
            for i in verify_rows:
                rows += range(batch.logits_indices[i], batch.logits_indices[i] + 1 + len(drafts_of[requests[i].key]))
            if len(rows) == hidden.shape[0] and rows == list(range(len(rows))):
                selected = hidden  # every row, in order (a decode batch without padding): no gather
            else:
                selected = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
            all_logits = self.model.compute_logits(selected)  # [len(rows), vocab]
            logits = all_logits[:len(sample_rows)]  # [num_sampling, vocab]
            to_sample = [requests[i] for i in sample_rows]
            # Tokens, logprobs, and per row whether the logits are all finite (the sentinel's check).
            tokens, logprobs, finite = self.sampler.sample_step(logits, to_sample) if to_sample else ([], [], [])
            for request, token, lp, ok in zip(to_sample, tokens, logprobs, finite):
                out.sampled[request.key] = token
                if lp is not None:
                    out.logprobs[request.key] = lp
                if not ok:
                    out.nan_logits.add(request.key)
            self._verify([requests[i] for i in verify_rows], drafts_of, all_logits[len(sample_rows):], out)
        self._prompt_logprobs(sched, batch, hidden, out)
        return out

    def _verify(self, requests: list[Request], drafts_of: dict[str, list[int]],
                logits: torch.Tensor,  # [sum(1 + k), vocab] each request's verified rows, in order
                out: RunnerOutput) -> None:
        """Speculative decoding: each request's emitted run (accepted drafts + one token)."""
        start = 0
        for request in requests:
            drafts = drafts_of[request.key]
            rows = logits[start:start + 1 + len(drafts)]
            start += 1 + len(drafts)
            run = self.sampler.verify(rows, request, drafts)
            out.sampled[request.key] = run[0]
            out.spec_runs[request.key] = run
            if not bool(torch.isfinite(rows.float().sum()).item()):
                out.nan_logits.add(request.key)

    def _prompt_logprobs(self, sched: SchedulerOutput, batch: StepBatch, hidden: torch.Tensor,
                         out: RunnerOutput) -> None:
        """Logprob of each scheduled prompt token given the ones before it (teacher forcing)."""
        starts = batch.meta.query_start_loc_cpu
        for row, (request, num_new) in enumerate(sched.scheduled):
            num_top = request.params.prompt_logprobs
            first = request.num_computed_tokens
            if num_top is None or first >= request.num_prompt_tokens:
                continue
            # Token t (t >= 1) is predicted by position t - 1; this chunk covers positions
            # [first, first + num_new) so it predicts prompt tokens [first + 1, first + num_new].
            # After a preemption the prompt is recomputed; skip what was already sent.
            begin = max(first, request.prompt_logprobs_sent - 1)
            last = min(first + num_new, request.num_prompt_tokens - 1)
            if last <= begin:
                continue
            offset = starts[row] + begin - first
            rows = hidden[offset:offset + (last - begin)]
            logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            targets = request.all_token_ids[begin + 1:last + 1]
            out.prompt_logprobs[request.key] = token_logprobs(logprobs, targets, num_top)


def writable_blocks(sched: SchedulerOutput, block_size: int) -> list[int]:
    """The blocks a step may write, from the scheduler's view alone (not the slot buffer):
    each scheduled request's blocks over the positions it computes."""
    blocks: list[int] = []
    for request, num_new in sched.scheduled:
        first = request.num_computed_tokens
        blocks += request.block_ids[first // block_size:(first + num_new - 1) // block_size + 1]
    return blocks
