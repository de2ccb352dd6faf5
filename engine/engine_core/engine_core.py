"""One rank's engine: it drives a step -- the scheduler's plan (engine/core/), the model
runner (engine/worker/), the integrity unit around it (engine/integrity/) -- and turns the
sampled tokens into outputs.

Works on token ids only; detokenization and stop strings live in the front end
(engine/frontend/output_processor.py), which aborts a request when it sees a stop string.
"""
from __future__ import annotations

import time

import torch

from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.core.validation import validate_request
from engine.engine_core.preparing import PreparingRequests
from engine.engine_core.stop import finish_after
from engine.integrity.unit import CacheIntegrity
from engine.memory import host_memory
from engine.messages import EngineCoreOutput, EngineRequest, Refusal, RequestTiming, StepStats
from engine.request import Request, SchedulerOutput
from engine.spec_decode.speculator import Speculator
from engine.spec_decode.stats import SpecDecodeStats
from engine.structured.limits import check_spec_limits
from engine.worker.kv_cache import block_axis
from engine.worker.model_runner import ModelRunner, RunnerOutput


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
        self.integrity = CacheIntegrity(config, self.runner.kv_storage, block_axis(config),
                                        self.runner.null_block_writes, self.runner.write_guard.foreign_writes)
        self._eos_ids = frozenset(config.model.eos_token_ids)
        self.steps = 0
        self.dummy_batches = 0
        self.padded_tokens = 0
        self._pending: list[EngineCoreOutput] = []  # outputs produced outside step() (aborts)
        spec = config.speculative_config
        self.speculator = Speculator(spec, config.max_model_len) if spec is not None else None
        self.preparing = PreparingRequests(config)  # requests whose grammar compiles off the loop

    # -- requests -------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> None:
        """The cheap checks only: nothing here may stall the step loop (the grammar compiles later,
        off the loop)."""
        validate_request(self.config, request)
        if request.params.structured_outputs is not None:
            check_spec_limits(self.config, request.params.structured_outputs)

    def add_request(self, request: EngineRequest) -> None:
        self.validate(request)
        samples = []
        first = None
        for index in range(request.params.n):
            r = Request(request.request_id, index, request.prompt_token_ids, request.params,
                        request.eos_token_id, request.arrival_time or time.time(), wait_for=first,
                        priority=request.priority)
            r.eos_token_ids = self._eos_ids | ({request.eos_token_id} - {None})
            first = first or r
            samples.append(r)
        if request.params.structured_outputs is not None:  # waits, unschedulable, until compiled
            self.preparing.add(request.request_id, request.params.structured_outputs, samples)
        for r in samples:
            self.scheduler.add(r)

    def refused(self, request: EngineRequest, exc: ValueError) -> list[EngineCoreOutput]:
        """The outputs that tell the front end `request` was refused before it ran (add_request
        raised `exc`): finish_reason "error" with a typed Refusal, which it answers as a 400."""
        refusal = refusal_of(exc)
        return [EngineCoreOutput(request.request_id, i, [], finish_reason="error", stop_reason=refusal.message,
                                 refusal=refusal) for i in range(request.params.n)]

    def _poll_grammars(self) -> None:
        for samples, exc in self.preparing.poll():
            refusal = refusal_of(exc)
            for r in samples:
                self.scheduler.finish(r, "error", refusal.message)
                self._pending.append(EngineCoreOutput(r.request_id, r.index, [], finish_reason="error",
                                                      stop_reason=refusal.message, refusal=refusal))

    @property
    def only_preparing(self) -> bool:
        """Every unfinished request waits for its grammar: a step would have nothing to run."""
        return (not self.scheduler.running and bool(self.scheduler.waiting)
                and all(r.waiting_for_grammar for r in self.scheduler.waiting))

    def abort(self, request_ids: list[str], index: int | None = None) -> None:
        for request_id in request_ids:
            aborted = self.scheduler.abort(request_id, index)
            if not any(r.request_id == request_id for r in self.scheduler.requests.values()):
                self.preparing.drop(request_id)  # frees its compile too, unless it started or is shared
            for request in aborted:
                self._pending.append(EngineCoreOutput(request.request_id, request.index, [],
                                                      finish_reason="abort", timing=self._timing(request)))

    def take_pending(self) -> list[EngineCoreOutput]:
        outputs, self._pending = self._pending, []
        return outputs

    def inject_fault(self, fault) -> None:
        from engine.worker.faults import inject, stale_dummy_tokens
        inject(self.runner, fault, self.integrity.checksums)
        if fault.kind == "stale_slot_dummy" and not self.config.lockstep:
            # Nothing else steps dummy batches here: replay the broken one now.
            self.run_dummy(self.config.padded_num_tokens(stale_dummy_tokens(self.runner)))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- stepping ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._poll_grammars()
        return self.scheduler.schedule()

    def step(self, sched: SchedulerOutput | None = None, num_padded: int | None = None) -> list[EngineCoreOutput]:
        """Run one step. `num_padded` (DP lockstep) pads the batch to the group's token count."""
        if sched is None:
            sched = self.schedule()
        outputs = self.take_pending()
        if sched.num_reqs == 0:  # not a step (e.g. only requests waiting for their grammar)
            if num_padded:
                self.run_dummy(num_padded)
            return outputs + self.take_pending()
        self.steps += 1
        self.integrity.before_step(self.scheduler.kv.pool.take_unsealed())
        num_padded = num_padded or self.config.padded_num_tokens(sched.num_tokens)
        self.padded_tokens += num_padded - sched.num_tokens
        result = self.runner.execute(sched, num_padded)
        outputs += self._update(sched, result)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
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
        """After a step: the integrity unit over what it wrote (None: nothing); under
        --nan-policy heal, the requests reading a block it quarantines end with "error"."""
        pool = self.scheduler.kv.pool
        quarantine = self.integrity.after_step(written_slots, self.config.block_size, pool.take_unsealed(),
                                               lambda block: pool.block_hash[block] is not None)
        for block, reason in quarantine:
            readers = [r for r in list(self.scheduler.requests.values()) if block in r.block_ids]
            for request in readers:
                self.scheduler.finish(request, "error", reason)
                self._pending.append(EngineCoreOutput(request.request_id, request.index, [],
                                                      finish_reason="error", stop_reason=reason,
                                                      timing=self._timing(request)))
            pool.drop_from_cache(block)
            self.integrity.quarantined(block, len(readers))

    def _update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        max_len = self.config.max_model_len
        block_size = self.config.block_size
        for request, num_new in sched.scheduled:
            drafts = sched.spec_token_ids.get(request.key, ())
            run = result.spec_runs.get(request.key)
            if run is not None:  # rollback: the rejected drafts' positions are not computed tokens
                num_new -= len(drafts) - (len(run) - 1)
            full_before = request.num_computed_tokens // block_size
            request.num_computed_tokens += num_new
            appended = None
            if run is not None:
                # The accepted drafts become tokens before their blocks are sealed and hashed for
                # the prefix cache; a stop inside the run drops the rest, computed or not.
                appended = self._append(request, run, max_len)
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            self.integrity.filled(request.block_ids[full_before:request.num_computed_tokens // block_size])
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
            new_tokens, reason, stop_reason = appended or self._append(request, [token], max_len)
            request.record_token()
            if run is not None:
                self.speculator.record(request, len(drafts), len(run) - 1)
                if reason is None:
                    self.scheduler.kv.trim(request)
            lp = result.logprobs.get(request.key)
            out = EngineCoreOutput(request.request_id, request.index, new_tokens,
                                   new_logprobs=[lp] if lp is not None else None,
                                   prompt_logprobs=self._prompt_lp_list(first_chunk, prompt_lps) if prompt_lps else None,
                                   num_cached_tokens=max(request.num_cached_tokens, 0))
            if request.num_output_tokens == 1 and request.first_scheduled_at is not None:
                out.queue_seconds = request.first_scheduled_at - request.added_at
            if request.key in result.nan_logits and self.integrity.bad_logits():
                reason, stop_reason = "error", "non-finite logits"
            if reason is not None:
                self.scheduler.finish(request, reason, stop_reason)
                out.finish_reason, out.stop_reason = reason, stop_reason
                out.timing = self._timing(request)
            outputs.append(out)
        return outputs

    def _timing(self, request: Request) -> RequestTiming:
        def since_arrival(stamp: float | None) -> float | None:
            return None if stamp is None else stamp - request.added_at
        return RequestTiming(self.rank, since_arrival(request.first_scheduled_at),
                             since_arrival(request.first_token_at), since_arrival(request.last_token_at))

    @staticmethod
    def _append(request: Request, tokens: list[int], max_len: int) -> tuple[list[int], str | None, int | str | None]:
        """Append a step's tokens (several after a verify step) one by one, each checked by the
        stop rules as if sampled alone: a stop inside an accepted run ends the request there."""
        for count, token in enumerate(tokens, 1):
            request.all_token_ids.append(token)
            reason, stop_reason = finish_after(request, token, max_len)
            if reason is not None:
                return tokens[:count], reason, stop_reason
        return tokens, None, None

    @staticmethod
    def _prompt_lp_list(first_chunk: bool, entries):
        # The first chunk carries a leading None: the first prompt token has no logprob.
        return [None] + entries if first_chunk else entries

    def stats(self) -> StepStats:
        """Read when the rank reports, not every step: the integrity counters cost a host sync on CUDA."""
        kv = self.scheduler.kv
        return StepStats(
            rank=self.rank, steps=self.steps, dummy_batches=self.dummy_batches,
            padded_tokens=self.padded_tokens, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), kv_usage=kv.pool.usage,
            prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
            preemptions=self.scheduler.num_preemptions, integrity=self.integrity.stats(),
            spec_decode=self.speculator.stats.copy() if self.speculator is not None else SpecDecodeStats(),
            num_preparing=self.preparing.num_waiting)


def refusal_of(exc: ValueError) -> Refusal:
    """A refusal's typed form; the field is the text before ": " when the error has no `field`."""
    message = str(exc)
    field = getattr(exc, "field", None) or (message.partition(": ")[0] if ": " in message else None)
    return Refusal(field, message, getattr(exc, "code", "invalid_value"))
