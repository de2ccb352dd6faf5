"""Requests whose grammar is compiling: they wait in the scheduler's queue, unschedulable
(`Request.waiting_for_grammar`), while every other request steps -- vLLM's WAITING_FOR_FSM.

The compile runs on a worker thread (engine/structured/compile_pool.py); the engine core polls
here once per schedule, arms the samples whose grammar is ready, and hands back those refused:
a spec that cannot compile, or one still compiling when its deadline passes.
"""
from __future__ import annotations

import time

import xgrammar as xgr

from engine.config import EngineConfig
from engine.request import Request
from engine.structured.compile_pool import GrammarPool, PendingGrammar
from engine.structured.grammar import GrammarError, RequestGrammar, compiler_for_model
from engine.structured.limits import check_spec_limits
from engine.structured.spec import StructuredOutputs


def compile_blocking(config: EngineConfig, spec: StructuredOutputs) -> None:
    """Check and compile `spec` in the caller's thread (the offline LLM, which blocks anyway):
    raises SpecTooLarge or GrammarError naming the field."""
    check_spec_limits(config, spec)
    compiler_for_model(config.model).compile(spec)


class PreparingRequests:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._pool: GrammarPool | None = None  # started with the first constrained request
        self._waits: dict[str, tuple[PendingGrammar, StructuredOutputs, list[Request]]] = {}

    def _compile(self, spec: StructuredOutputs):
        # On the worker thread, so that building the compiler (the vocabulary's token info, once
        # per process) does not stall a step either.
        return compiler_for_model(self.config.model).compile(spec)

    def add(self, request_id: str, spec: StructuredOutputs, samples: list[Request]) -> None:
        if self._pool is None:
            self._pool = GrammarPool(self._compile, self.config.structured_outputs_compile_workers,
                                     self.config.structured_outputs_compile_timeout)
        for request in samples:
            request.waiting_for_grammar = True
        self._waits[request_id] = (self._pool.submit(spec), spec, samples)

    @property
    def num_waiting(self) -> int:
        return sum(len(samples) for _, _, samples in self._waits.values())

    def poll(self) -> list[tuple[list[Request], GrammarError]]:
        """Arm the samples whose grammar compiled; return (samples, why) of those refused."""
        refused = []
        now = time.monotonic()
        for request_id, (pending, spec, samples) in list(self._waits.items()):
            if all(r.is_finished for r in samples):  # aborted while waiting
                self.drop(request_id)
                continue
            try:
                compiled = pending.result(now)
            except GrammarError as exc:
                del self._waits[request_id]
                refused.append((samples, exc))
                continue
            if compiled is None:
                continue
            del self._waits[request_id]
            for request in samples:  # one matcher per sample
                request.grammar = RequestGrammar(xgr.GrammarMatcher(compiled), spec.after_token_ids)
                request.waiting_for_grammar = False
        return refused

    def drop(self, request_id: str) -> None:
        """Forget `request_id` (aborted): its compile is cancelled unless it started or is shared."""
        wait = self._waits.pop(request_id, None)
        if wait is not None:
            wait[0].release()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
