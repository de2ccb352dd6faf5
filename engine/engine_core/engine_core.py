"""One rank's engine: scheduler + model runner, stepped by `step()`.

Works on token ids only; detokenization and stop strings live in the front end
(engine/frontend/output_processor.py), which aborts a request when it sees a stop string.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.config import EngineConfig
from engine.paging import NULL_BLOCK_ID
from engine.messages import EngineCoreOutput, EngineRequest, StepStats
from engine.worker.kv_cache import block_axis
from engine.worker.model_runner import ModelRunner, RunnerOutput
from engine.core.scheduler import Scheduler
from engine.request import Request, SchedulerOutput
from engine.core.validation import validate_request
from engine.memory import host_memory
from engine.integrity.checksums import BlockChecksums
from engine.integrity.sentinel import NaNSentinel
from engine.structured.grammar import GrammarCompiler, compiler_for_model

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.rank = config.parallel.data_parallel_rank
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            host_memory.keep_freed_memory()  # activations reuse heap pages instead of faulting them in
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(config)
        axis = block_axis(config)
        self.sentinel = NaNSentinel(config, self.runner.kv_storage, axis, self.runner.null_block_writes)
        self.checksums = BlockChecksums(config, self.runner.kv_storage, axis)
        self.checksum_mismatches = {"prefix_cache": 0, "running": 0}
        self._sealing: list[int] = []  # blocks this step filled, sealed once the step is done
        self.heals = 0
        self._eos_ids = frozenset(config.model.eos_token_ids)
        self.nan_policy_tripped = False
        self.steps = 0
        self.dummy_batches = 0
        self.padded_tokens = 0
        self.corrupted_requests = 0
        self._pending: list[EngineCoreOutput] = []  # outputs produced outside step() (aborts)

    # -- requests -------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> None:
        validate_request(self.config, request)
        if request.params.structured_outputs is not None:
            self.grammar_compiler().compile(request.params.structured_outputs)

    def grammar_compiler(self) -> GrammarCompiler:
        return compiler_for_model(self.config.model)

    def add_request(self, request: EngineRequest) -> None:
        self.validate(request)
        first = None
        for index in range(request.params.n):
            r = Request(request.request_id, index, request.prompt_token_ids, request.params,
                        request.eos_token_id, request.arrival_time or time.time(), wait_for=first)
            r.eos_token_ids = self._eos_ids | ({request.eos_token_id} - {None})
            if request.params.structured_outputs is not None:  # one matcher per sample
                r.grammar = self.grammar_compiler().matcher(request.params.structured_outputs)
            first = first or r
            self.scheduler.add(r)

    def abort(self, request_ids: list[str], index: int | None = None) -> None:
        for request_id in request_ids:
            for request in self.scheduler.abort(request_id, index):
                self._pending.append(EngineCoreOutput(request.request_id, request.index, [],
                                                      finish_reason="abort"))

    def take_pending(self) -> list[EngineCoreOutput]:
        outputs, self._pending = self._pending, []
        return outputs

    def inject_fault(self, fault) -> None:
        from engine.worker.faults import inject, stale_dummy_tokens
        inject(self.runner, fault, self.checksums)
        if fault.kind == "stale_slot_dummy" and not self.config.lockstep:
            # Nothing else steps dummy batches here: replay the broken one now.
            self.run_dummy(self.config.padded_num_tokens(stale_dummy_tokens(self.runner)))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- stepping ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def step(self, sched: SchedulerOutput | None = None, num_padded: int | None = None) -> list[EngineCoreOutput]:
        """Run one step. `num_padded` (DP lockstep) pads the batch to the group's token count."""
        if sched is None:
            sched = self.schedule()
        outputs = self.take_pending()
        self.steps += 1
        if sched.num_reqs == 0:
            if num_padded:
                self.steps -= 1
                self.run_dummy(num_padded)
            return outputs + self.take_pending()
        # Blocks the scheduler just handed out lose their checksums before the step rewrites them.
        self.checksums.unseal(self.scheduler.kv.pool.take_unsealed())
        num_padded = num_padded or self.config.padded_num_tokens(sched.num_tokens)
        self.padded_tokens += num_padded - sched.num_tokens
        result = self.runner.execute(sched, num_padded)
        outputs += self._update(sched, result)
        self._watch_cache(result.written_slots)
        return outputs + self.take_pending()

    def run_dummy(self, num_padded: int) -> None:
        self.steps += 1
        self.dummy_batches += 1
        self.padded_tokens += num_padded
        self._watch_cache(self.runner.run_dummy(num_padded))

    def idle_scan(self) -> None:
        """A sentinel pass between steps (idle ranks call it on every heartbeat)."""
        self._watch_cache(None)

    def _watch_cache(self, written_slots: torch.Tensor | None) -> None:
        """After a step: the NaN sentinel over what it wrote (None: nothing), the checksums of the
        blocks it sealed and the checksum sweep; then the NaN policy for what they found."""
        poisoned = self.sentinel.step(written_slots, self.config.block_size)
        pool = self.scheduler.kv.pool
        self.checksums.seal(self._sealing)
        self._sealing = []
        self.checksums.unseal(pool.take_unsealed())  # freed by this step (finished, aborted)
        mismatched = self.checksums.verify()
        for block, layers in mismatched:
            region = "prefix_cache" if pool.block_hash[block] is not None else "running"
            self.checksum_mismatches[region] += 1
            log.warning("rank %d: KV block %d (%s) changed after it was sealed, in layers %s",
                        self.rank, block, region, layers)
        policy = self.config.nan_policy
        if policy == "fail" and (poisoned or mismatched or self.sentinel.null_block_poisoned):
            self.nan_policy_tripped = True
        if policy != "heal":
            return
        if self.sentinel.null_block_poisoned:
            self.sentinel.zero_block(NULL_BLOCK_ID)
            self.heals += 1
        for block in self.sentinel.poisoned_blocks():
            self._heal_block(block, "kv cache block poisoned")
        for block, _ in mismatched:
            self._heal_block(block, "kv cache block checksum mismatch")

    def _heal_block(self, block: int, reason: str) -> None:
        """Abort every request reading `block` with "error", forget and zero the block."""
        owners = [r for r in list(self.scheduler.requests.values()) if block in r.block_ids]
        for request in owners:
            self.corrupted_requests += 1
            self.scheduler.finish(request, "error", reason)
            self._pending.append(EngineCoreOutput(request.request_id, request.index, [],
                                                  finish_reason="error", stop_reason=reason))
        self.scheduler.kv.pool.drop_from_cache(block)
        self.sentinel.zero_block(block)
        self.checksums.unseal([block])
        self.heals += 1

    def _update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        max_len = self.config.max_model_len
        block_size = self.config.block_size
        for request, num_new in sched.scheduled:
            full_before = request.num_computed_tokens // block_size
            request.num_computed_tokens += num_new
            self._sealing += request.block_ids[full_before:request.num_computed_tokens // block_size]
            self.scheduler.kv.cache_computed_blocks(request)
            prompt_lps = result.prompt_logprobs.get(request.key)
            first_chunk = request.prompt_logprobs_sent == 1
            if prompt_lps:
                request.prompt_logprobs_sent += len(prompt_lps)
            token = result.sampled.get(request.key)
            if token is None:
                if prompt_lps:
                    outputs.append(EngineCoreOutput(request.request_id, request.index, [],
                                                    prompt_logprobs=self._prompt_lp_list(first_chunk, prompt_lps)))
                continue
            request.all_token_ids.append(token)
            lp = result.logprobs.get(request.key)
            out = EngineCoreOutput(request.request_id, request.index, [token],
                                   new_logprobs=[lp] if lp is not None else None,
                                   prompt_logprobs=self._prompt_lp_list(first_chunk, prompt_lps) if prompt_lps else None,
                                   num_cached_tokens=max(request.num_cached_tokens, 0))
            if request.num_output_tokens == 1 and request.first_scheduled_at is not None:
                out.queue_seconds = request.first_scheduled_at - request.added_at
            reason, stop_reason = self._check_stop(request, token, max_len)
            if request.grammar is not None and reason is None:
                if not request.grammar.accept(request.output_token_ids):
                    reason, stop_reason = "error", "token refused by the grammar"
                elif request.grammar.is_terminated:
                    reason = "stop"
            if request.key in result.nan_logits:
                self.corrupted_requests += 1
                if self.config.nan_policy in ("heal", "fail"):
                    reason, stop_reason = "error", "non-finite logits"
            if reason is not None:
                self.scheduler.finish(request, reason, stop_reason)
                out.finish_reason, out.stop_reason = reason, stop_reason
            outputs.append(out)
        return outputs

    @staticmethod
    def _prompt_lp_list(first_chunk: bool, entries):
        # The first chunk carries a leading None: the first prompt token has no logprob.
        return [None] + entries if first_chunk else entries

    @staticmethod
    def _check_stop(request: Request, token: int, max_len: int) -> tuple[str | None, int | None]:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_len:
            return "length", None
        return None, None

    def stats(self) -> StepStats:
        kv = self.scheduler.kv
        seal_seconds, verify_seconds = self.checksums.take_seconds()
        return StepStats(
            rank=self.rank, steps=self.steps, dummy_batches=self.dummy_batches,
            padded_tokens=self.padded_tokens, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), kv_usage=kv.pool.usage,
            prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
            preemptions=self.scheduler.num_preemptions,
            null_block_writes=int(self.runner.null_block_writes.item()),
            corrupted_requests=self.corrupted_requests,
            nan_values=self.sentinel.values() if self.sentinel.enabled else [],
            nan_detections=list(self.sentinel.detections.items()),
            heals=self.heals, scan_seconds=self.sentinel.take_scan_seconds(),
            scan_coverage_steps=self.sentinel.coverage_steps,
            nan_policy_tripped=self.nan_policy_tripped,
            foreign_writes=int(self.runner.write_guard.foreign_writes.item()),
            checksum_mismatches=list(self.checksum_mismatches.items()),
            sealed_blocks=self.checksums.num_sealed, checksum_coverage_steps=self.checksums.coverage_steps,
            seal_seconds=seal_seconds, verify_seconds=verify_seconds)
