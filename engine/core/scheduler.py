"""Continuous batching without prefill/decode phases.

Each request only has "computed tokens"; every step gives each running request
the tokens it still needs (a whole prompt, a prompt chunk, or the one token
sampled last step) within the token and sequence budgets, FCFS. When blocks run
out the newest running request is preempted (its blocks freed, recomputed
later from the front of the queue).

Under --scheduling-policy priority the queue and the running list are ordered by
priority instead (engine/core/request_queue.py): "front" and "newest" read as
"best" and "lowest" in that order.
"""
from __future__ import annotations

import time

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request_queue import make_request_queue
from engine.request import Request, RequestStatus, SchedulerOutput


class Scheduler:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting = make_request_queue(config)  # also orders `running`: its last is preempted first
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.requests[request.key] = request
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.waiting.step()
        budget = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len
        scheduled_running: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                          max_len - request.num_computed_tokens)
            if num_new <= 0:
                index += 1
                continue
            drafts = self._fit_drafts(request, num_new, budget, len(self.running) - index)
            num_new += len(drafts)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled_running.append(request)
                out.scheduled.append((request, num_new))
                if drafts:
                    out.spec_token_ids[request.key] = drafts
                budget -= num_new
                index += 1
                continue
            break  # the request preempted itself: nothing more fits this step

        if not out.preempted:
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting.peek()
                if not request.ready:
                    skipped.append(self.waiting.pop())
                    continue
                computed = (self.kv.get_computed_blocks(request)
                            if request.num_computed_tokens == 0 and request.params.prompt_logprobs is None else [])
                num_cached = len(computed) * self.config.block_size
                num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
                if not self.kv.allocate_slots(request, num_new, computed):
                    break
                self.waiting.pop()
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_cached
                if self.config.enable_prefix_caching and request.params.prompt_logprobs is None:
                    self.kv.record_prefix_lookup(request.num_tokens, num_cached)
                request.status = RequestStatus.RUNNING
                if request.first_scheduled_at is None:
                    request.first_scheduled_at = time.monotonic()
                self.waiting.place_running(self.running, request)
                out.scheduled.append((request, num_new))
                budget -= num_new
            self.waiting.restore(skipped)
        # One-token (decode) requests first: attention batches that leading run in one call.
        out.scheduled.sort(key=lambda item: item[1] != 1)
        return out

    def _fit_drafts(self, request: Request, num_new: int, budget: int, num_left: int) -> list[int]:
        """Speculative decoding: the draft tokens that ride after a decoding request's one new
        token, as many as the token budget and max_model_len allow; none unless their lookahead
        blocks come from free blocks that leave one for each of the `num_left` running requests
        still to schedule (a lookahead never causes a preemption)."""
        drafts = request.draft_token_ids
        if not drafts or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        drafts = drafts[:min(budget - 1, self.config.max_model_len - request.num_tokens)]
        if not drafts or self.kv.blocks_needed(request, 1 + len(drafts)) + num_left > self.kv.pool.num_free_blocks:
            return []
        return drafts

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.requeue(request)
        self.num_preemptions += 1

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        if request.is_finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.discard(request)
        self.waiting.forget(request)
        self.kv.free(request)
        self.requests.pop(request.key, None)

    def abort(self, request_id: str, index: int | None = None) -> list[Request]:
        """Abort every sample (or sample `index`) of client request `request_id`."""
        aborted = [r for r in self.requests.values()
                   if r.request_id == request_id and (index is None or r.index == index)]
        for request in aborted:
            self.finish(request, "abort")
        return aborted
