"""The order a scheduling policy (--scheduling-policy) puts requests in: the waiting queue the
scheduler admits from, and the order of the running list, whose last request is the one
preempted when KV blocks run out.

- fcfs: arrival order. A preempted request goes back to the front of the queue; the newest
  running request is preempted first.
- priority: by each request's rank, then arrival (first come, first served among equals).
  A request's rank is `priority * aging_steps + arrival_step`, where `arrival_step` counts the
  scheduler steps before it arrived: its effective priority improves by one level for every
  `aging_steps` steps it has been on the rank (0: no aging, the rank is `priority`). Lower runs
  first, as in vLLM. The running list is kept in the same order, so the one preempted is the
  lowest-ranked: the lowest priority, the latest arrival among equals.

Why aging counts steps, not seconds: it bounds starvation the same way on a fast GPU and a
slow CPU, and a test can replay it exactly. Why aging also orders the running list: a request
the queue let through because it aged must not be the next victim by its plain priority,
or it would starve again. The bound: a request of priority p is never overtaken by a request
of priority q that arrived more than (p - q) * aging_steps steps after it.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine.config import EngineConfig
from engine.request import Request


class RequestQueue:
    """fcfs: the waiting queue in arrival order, and the running list in admission order."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def step(self) -> None:
        """A scheduler step begins (aging counts them)."""

    def add(self, request: Request) -> None:
        """A new request."""
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        """A preempted request: back in the queue, ahead of every later arrival."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def restore(self, requests: list[Request]) -> None:
        """Requests popped and not admitted (a sibling not yet ready) go back where they were."""
        self._queue.extendleft(reversed(requests))

    def discard(self, request: Request) -> None:
        """A waiting request that finished (aborted): out of the queue, when there."""
        try:
            self._queue.remove(request)
        except ValueError:
            pass

    def forget(self, request: Request) -> None:
        """A request that finished, waiting or running."""

    def place_running(self, running: list[Request], request: Request) -> None:
        """An admitted request joins the running list; its last entry is preempted first."""
        running.append(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]


class PriorityRequestQueue(RequestQueue):
    """priority: a heap on (rank, arrival); the running list sorted the same way."""

    def __init__(self, aging_steps: int) -> None:
        self.aging_steps = aging_steps
        self.steps = 0
        self._arrivals = itertools.count()
        self._order: dict[Request, tuple[int, int]] = {}  # request -> (rank, arrival), while on the rank
        self._heap: list[tuple[tuple[int, int], Request]] = []

    def order(self, request: Request) -> tuple[int, int]:
        return self._order[request]

    def step(self) -> None:
        self.steps += 1

    def add(self, request: Request) -> None:
        rank = request.priority * self.aging_steps + self.steps if self.aging_steps else request.priority
        self._order[request] = (rank, next(self._arrivals))
        self._push(request)

    def requeue(self, request: Request) -> None:
        self._push(request)  # its place is its rank and arrival, kept from when it came

    def _push(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._order[request], request))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def restore(self, requests: list[Request]) -> None:
        for request in requests:
            self._push(request)

    def discard(self, request: Request) -> None:
        kept = [entry for entry in self._heap if entry[1] is not request]
        if len(kept) != len(self._heap):
            heapq.heapify(kept)
            self._heap = kept

    def forget(self, request: Request) -> None:
        self._order.pop(request, None)

    def place_running(self, running: list[Request], request: Request) -> None:
        bisect.insort(running, request, key=self._order.__getitem__)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([request for _, request in sorted(self._heap)])

    def __getitem__(self, index: int) -> Request:
        return list(self)[index]


def make_request_queue(config: EngineConfig) -> RequestQueue:
    if config.scheduling_policy == "priority":
        return PriorityRequestQueue(config.priority_aging_steps)
    return RequestQueue()
