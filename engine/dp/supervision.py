"""What the front end's rank supervisor decides, without the processes: when to respawn a dead
rank (crash-loop backoff), when to give up, which ranks are wedged, and the counters its
metrics read.

The process side -- a sentinel fd per local rank watched by the event loop, the re-queue of
requests, the lockstep group's re-forming -- is engine/dp/async_client.py.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from engine.config import EngineConfig

BACKOFF_FIRST_SECONDS = 1.0  # a rank's second death within the window waits this long, then 2x each time
BACKOFF_MAX_SECONDS = 30.0
RESTART_REASONS = ("killed", "exited", "wedged")  # by a signal, by an exit code, by the wedge detector
WATCH_SECONDS = 0.25  # how often the wedge detector looks


@dataclass
class SupervisionCounters:
    """Read by the service's metrics at scrape time."""
    restarts: Counter = field(default_factory=Counter)  # (rank, reason) -> respawns
    requeued: int = 0                  # requests moved to another (or the re-formed) rank unseen
    failed_by_rank_death: int = 0      # requests that had streamed output when their rank died
    live_ranks: int = 0
    ranks: tuple[int, ...] = ()        # every rank this front end supervises: each series exists from 0


class CrashLoop:
    """Rank deaths within the last `window` seconds. A rank's first death in the window is
    respawned at once, the next after 1 s, then 2 s, 4 s ... (at most 30 s); more than
    `max_restarts` deaths of any ranks within the window is a crash loop."""

    def __init__(self, max_restarts: int, window: float):
        self.max_restarts = max_restarts
        self.window = window
        self.deaths: deque[tuple[float, int]] = deque()  # (time.monotonic(), rank), oldest first

    @classmethod
    def for_config(cls, config: EngineConfig) -> "CrashLoop":
        return cls(config.max_rank_restarts, config.rank_restart_window)

    def record(self, rank: int, now: float) -> float | None:
        """A death of `rank` at `now`: seconds to wait before respawning it, or None to give up."""
        self.deaths.append((now, rank))
        while self.deaths and self.deaths[0][0] < now - self.window:
            self.deaths.popleft()
        if len(self.deaths) > self.max_restarts:
            return None
        repeats = sum(1 for _, r in self.deaths if r == rank) - 1
        return 0.0 if repeats == 0 else min(BACKOFF_FIRST_SECONDS * 2 ** (repeats - 1), BACKOFF_MAX_SECONDS)

    def verdict(self) -> str:
        return f"crash loop: {len(self.deaths)} DP rank deaths within {self.window:g} s " \
               f"(--max-rank-restarts {self.max_restarts})"


def silent_ranks(last_seen: dict[int, float], ready: set[int], now: float, timeout: float) -> list[tuple[float, int]]:
    """Ready ranks unheard for `timeout` at `now`, as (last heard, rank), longest-silent first.
    Silence is judged on what the front end has read: when it was held up itself (a busy host,
    a blocked event loop), what the ranks sent meanwhile still waits in its sockets, so the
    detector skips a round that woke late (never two in a row) and re-asks once its readers
    have run."""
    return sorted((last_seen[r], r) for r in ready if now - last_seen[r] > timeout)
