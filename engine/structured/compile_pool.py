"""Grammar compiles off the step loop: a bounded pool of threads, and a deadline per request.

xgrammar releases the GIL while it compiles (measured 2026-12-04, Xeon AMX 2 cores shared, a
9,000-string enum compiling for 9 s: a Python thread sleeping 5 ms at a time woke every 5-130 ms
throughout), so a thread is enough to keep the rank stepping. The rank polls its pending
grammars once per schedule; a request waits in the queue until its grammar is ready
(engine/request.py: `Request.ready`), or is refused when the deadline passes first.

xgrammar cannot interrupt a compile: one past its deadline runs on in its thread until it
ends, holding that worker. The size bounds (engine/structured/limits.py) keep every spec they
let through far below the deadline; the pool's size caps the cores runaway compiles can take;
and requests with the same spec share one compile, so repeating a slow spec costs nothing more.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

import msgspec
import xgrammar as xgr

from engine.structured.grammar import GrammarError
from engine.structured.spec import StructuredOutputs

COMPILE_TIMEOUT = "structured_outputs_compile_timeout"  # the error code of a deadline refusal


class CompileTimeout(GrammarError):
    code = COMPILE_TIMEOUT


class PendingGrammar:
    """One request's wait for its compiled grammar."""

    def __init__(self, pool: "GrammarPool", key: StructuredOutputs, future: Future, deadline: float):
        self.pool, self.key, self.future, self.deadline = pool, key, future, deadline
        self.released = False

    def result(self, now: float) -> xgr.CompiledGrammar | None:
        """The compiled grammar, or None while it is still compiling within the deadline.
        Raises GrammarError when the spec cannot compile, CompileTimeout past the deadline."""
        if self.future.done():
            self.release()
            try:
                return self.future.result()
            except CancelledError:  # another waiter's release cancelled it before it started
                pass
        elif now < self.deadline:
            return None
        self.release()
        raise CompileTimeout(f"structured_outputs.{self.key.kind}: not compiled within this server's "
                             f"{self.pool.timeout:g}s (--structured-outputs-compile-timeout); "
                             "simplify the spec")

    def release(self) -> None:
        """The request no longer waits (ready, refused or aborted); idempotent."""
        if not self.released:
            self.released = True
            self.pool.release(self)


class _DaemonWorkers:
    """A fixed set of daemon threads running submitted calls. Not a ThreadPoolExecutor: its
    threads are joined at exit, so a compile running on past its deadline would hold a stopping
    rank process until it ends (minutes for a hostile spec)."""

    def __init__(self, count: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(count):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable, arg) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, arg))
        return future

    def shutdown(self, count: int) -> None:
        for _ in range(count):
            self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, arg = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                future.set_result(fn(arg))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


class GrammarPool:
    def __init__(self, compile: Callable[[StructuredOutputs], xgr.CompiledGrammar], workers: int, timeout: float):
        self.compile = compile  # GrammarCompiler.compile, or what builds the compiler first
        self.timeout = timeout
        self.workers = workers
        self._executor = _DaemonWorkers(workers, "grammar-compile")
        self._lock = threading.Lock()  # guards _compiles: done-callbacks run on the worker threads
        self._compiles: dict[StructuredOutputs, tuple[Future, int]] = {}  # spec -> (its compile, waiters)

    def submit(self, spec: StructuredOutputs) -> PendingGrammar:
        # The grammar is keyed without the reasoning gate: the same schema compiles once for everyone.
        key = msgspec.structs.replace(spec, after_token_ids=())
        with self._lock:
            future, waiters = self._compiles.get(key, (None, 0))
            if future is None:
                future = self._executor.submit(self.compile, key)
            self._compiles[key] = (future, waiters + 1)
        return PendingGrammar(self, key, future, time.monotonic() + self.timeout)

    def release(self, pending: PendingGrammar) -> None:
        with self._lock:
            future, waiters = self._compiles.get(pending.key, (None, 0))
            if future is not pending.future:
                return
            if waiters > 1:
                self._compiles[pending.key] = (future, waiters - 1)
                return
            del self._compiles[pending.key]
        future.cancel()  # frees its worker if it had not started; a running compile runs on

    @property
    def num_compiling(self) -> int:
        with self._lock:
            return sum(1 for future, _ in self._compiles.values() if not future.done())

    def shutdown(self) -> None:
        with self._lock:
            for future, _ in self._compiles.values():
                future.cancel()
            self._compiles.clear()
        self._executor.shutdown(self.workers)
